"""Duplicate groups as columns: connected components over integer arrays, worked by hand and checked against a
breadth-first search over the same links."""

import numpy as np

from imgest.tasks.duplicates.groups import SIGNALS, found_by, group_items


def _groups(groups) -> list[tuple[str, list[int], float, str]]:
    """(kind, members, lowest cosine, found by) per group, in the groups' order."""
    return [("exact" if groups.exact[g] else "near", np.nonzero(groups.of_item == g)[0].tolist(),
             round(float(groups.min_score[g]), 4), found_by(int(groups.signals[g]))) for g in range(len(groups))]


def _pairs(*pairs):
    a, b, score, signal = zip(*pairs) if pairs else ((), (), (), ())
    return (np.array(a, np.int32), np.array(b, np.int32), np.array(score, np.float32),
            np.array([SIGNALS.index(s) for s in signal], np.int8))


def test_groups_join_through_members_and_exact_needs_equal_bytes():
    # items 0-4 (a b c d e by item_id): a and b share bytes; c-d scored 0.98 (a pair); e is no one's duplicate
    same_bytes = np.array([0, 0, 1, 2, 3], np.int32)
    groups = group_items(same_bytes, *_pairs((2, 3, 0.98, "embedding")))
    assert _groups(groups) == [("exact", [0, 1], 1.0, "bytes"), ("near", [2, 3], 0.98, "embedding")]
    assert groups.of_item.tolist() == [0, 0, 1, 1, -1] and groups.pair_group.tolist() == [1]
    # e scored 0.9 with a: under the threshold, but its perceptual hash matched: joined, and said so; the group
    # of three comes first (largest first), and is near: e's bytes differ
    with_hash = group_items(same_bytes, *_pairs((2, 3, 0.98, "embedding"), (0, 4, 0.9, "hash")))
    assert _groups(with_hash) == [("near", [0, 1, 4], 0.9, "hash"), ("near", [2, 3], 0.98, "embedding")]
    both = group_items(same_bytes, *_pairs((0, 2, 0.99, "embedding"), (3, 4, 0.9, "hash"), (2, 3, 0.95, "hash")))
    assert _groups(both) == [("near", [0, 1, 2, 3, 4], 0.9, "embedding+hash")]
    assert _groups(group_items(np.zeros(0, np.int32), *_pairs())) == []


def test_groups_are_the_components_a_search_over_the_pairs_finds():
    rng = np.random.default_rng(5)
    for n, edges in ((50, 20), (300, 250), (1000, 40)):
        same_bytes = rng.integers(0, n // 2, n).astype(np.int32)
        a, b = rng.integers(0, n, edges), rng.integers(0, n, edges)
        keep = a < b
        a, b = a[keep].astype(np.int32), b[keep].astype(np.int32)
        score = rng.uniform(0.9, 1.0, len(a)).astype(np.float32)
        groups = group_items(same_bytes, a, b, score, np.zeros(len(a), np.int8))
        linked = [set() for _ in range(n)]  # a breadth-first search over both kinds of link, item by item
        for x, y in [*zip(a.tolist(), b.tolist()), *((i, j) for i in range(n) for j in range(i)
                                                      if same_bytes[i] == same_bytes[j])]:
            linked[x].add(y)
            linked[y].add(x)
        seen, expected = set(), []
        for start in range(n):
            if start in seen:
                continue
            component, frontier = {start}, [start]
            while frontier:
                frontier = [y for x in frontier for y in linked[x] if y not in component]
                component.update(frontier)
            seen |= component
            if len(component) > 1:
                members = sorted(component)
                lowest = min((float(s) for x, s in zip(a.tolist(), score) if x in component), default=1.0)
                expected.append(("exact" if len({int(same_bytes[i]) for i in members}) == 1 else "near",
                                 members, round(lowest, 4)))
        expected.sort(key=lambda g: (-len(g[1]), g[1]))
        assert [g[:3] for g in _groups(groups)] == expected
        assert all(groups.of_item[x] == groups.pair_group[p] for p, x in enumerate(a.tolist()))
