"""The stopwatch behind every recorded figure of seconds, on a clock the test moves."""

from imgest.timing import Stopwatch


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_running_stopwatch_reads_the_time_since_it_started():
    clock = Clock()
    total = Stopwatch(clock)
    clock.now += 1.0009765625  # 1 + 2**-10 s: exact in binary
    assert total.elapsed == 1.0009765625 and total.seconds == 1.001  # recorded to the millisecond
    clock.now += 0.5
    assert total.seconds == 1.501


def test_blocks_are_summed_and_time_between_them_is_not():
    clock = Clock()
    encoding = Stopwatch(clock, running=False)
    for spent, idle in ((0.25, 10.0), (0.5, 3.0)):
        with encoding:
            clock.now += spent
        clock.now += idle  # waiting between batches is not encoding
    assert encoding.seconds == 0.75  # 0.25 + 0.5; the 13 s between blocks are left out
    with encoding:
        clock.now += 1.0
        assert encoding.elapsed == 1.75  # a block still running counts so far
