"""Learned whitening: the transforms (from the catalogue alone, and from matching pairs) worked out by hand on a
tiny matrix, the shrinkage, the dimension kept for a share of the variance, and the refusals."""

import numpy as np
import pytest

from imgest.tasks.heads.whiten import WhiteningError, fit_pair_whitening, fit_whitening

# Four points on the axes: mean 0; covariance (over n, as scikit-learn's empirical covariance) diag(2, 0.5):
# x: (2^2 + 2^2 + 0 + 0) / 4 = 2, y: (0 + 0 + 1 + 1) / 4 = 0.5, no cross term.
CROSS = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 1.0], [0.0, -1.0]])


def test_projection_by_hand_without_and_with_shrinkage():
    plain = fit_whitening(CROSS, shrinkage=0.0)
    # eigenvalues 2 (along x) then 0.5 (along y): rows scaled by 1/sqrt(2) = 0.7071 and 1/sqrt(0.5) = 1.4142
    np.testing.assert_allclose(np.abs(plain.projection), [[0.70711, 0], [0, 1.41421]], atol=1e-5)
    np.testing.assert_allclose(plain.mean, [0, 0], atol=1e-7)
    assert (plain.shrinkage, plain.shrinkage_source, plain.explained_variance, plain.sample) == (0.0, "given", 1.0, 4)
    # a = 0.5 pulls each eigenvalue halfway to their mean mu = (2 + 0.5) / 2 = 1.25:
    # 0.5 * 2 + 0.5 * 1.25 = 1.625 and 0.5 * 0.5 + 0.5 * 1.25 = 0.875; rows 1/sqrt of those = 0.7845, 1.0690
    shrunk = fit_whitening(CROSS, shrinkage=0.5)
    np.testing.assert_allclose(np.abs(shrunk.projection), [[0.78446, 0], [0, 1.06904]], atol=1e-5)
    # the cut to the first direction keeps x's share of the variance: 2 / (2 + 0.5) = 0.8
    cut = fit_whitening(CROSS, dim=1, shrinkage=0.0)
    assert cut.dim == 1 and cut.explained_variance == pytest.approx(0.8)
    # without --dim, the fewest directions holding a share of the variance: x alone holds 0.8
    assert fit_whitening(CROSS, variance=0.8).dim == 1 and fit_whitening(CROSS, variance=0.81).dim == 2


def test_pair_whitening_by_hand_weights_down_what_differs_between_two_pictures_of_an_item():
    # Two pictures of one item differ along y only: differences (0, +-0.5), covariance diag(0, 0.25). Shrunk
    # halfway to its mean eigenvalue 0.125: x 0.0625, y 0.1875, so it whitens by diag(1/sqrt): (4, 2.3094).
    pairs = np.array([[0.0, 0.0], [0.0, 0.0]]), np.array([[0.0, 0.5], [0.0, -0.5]])
    fitted = fit_pair_whitening(CROSS, *pairs, shrinkage=0.5)
    # the whitened catalogue is (+-8, 0) and (0, +-2.3094): variance 32 along x, 2.6667 along y, x first
    np.testing.assert_allclose(np.abs(fitted.projection), [[4.0, 0], [0, 2.30940]], atol=1e-5)
    assert (fitted.method, fitted.pairs, fitted.shrinkage_source) == ("pairs", 2, "given")
    # y, the direction a re-shoot changes, now weighs less than x (4 / 2.31), where the catalogue-only
    # whitening weighted it more (0.71 / 1.41): a view shifted along y stays nearer its item
    item, view, other = np.array([[2.0, 0.0]]), np.array([[2.0, 1.5]]), np.array([[0.0, 1.0]])
    for whitening, nearer in ((fitted, True), (fit_whitening(CROSS, shrinkage=0.5), False)):
        v, i, o = (whitening.apply(x)[0] for x in (view, item, other))
        assert bool(v @ i > v @ o) == nearer
    cut = fit_pair_whitening(CROSS, *pairs, dim=1, shrinkage=0.5)
    assert cut.dim == 1 and cut.explained_variance == pytest.approx(32 / (32 + 8 / 3))


def test_whitened_sample_has_identity_covariance_and_queries_transform_alike():
    rng = np.random.default_rng(0)
    mixing = rng.standard_normal((6, 6)) * np.array([5, 3, 1, 0.5, 0.2, 0.1])
    vectors = rng.standard_normal((500, 6)) @ mixing.T + 3.0
    fitted = fit_whitening(vectors, shrinkage=0.0)
    raw = (vectors - fitted.mean) @ fitted.projection.T  # before the L2 normalisation
    np.testing.assert_allclose(np.cov(raw.T, bias=True), np.eye(6), atol=1e-3)
    query = vectors[:3] + 0.01
    out = fitted.apply(np.vstack([vectors[:3], query]))
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    assert np.all((out[:3] * out[3:]).sum(1) > 0.99), "a query near an item lands near it: the same map"
    auto = fit_whitening(vectors)
    assert auto.shrinkage_source == "ledoit-wolf" and 0.0 <= auto.shrinkage <= 1.0


@pytest.mark.parametrize("vectors,kwargs,reason", [
    (np.ones((3, 4)), {}, "needs more than 4 items to fit on; got 3"),
    (CROSS, {"dim": 3}, "--dim 3 is above the base model's 2 dimensions"),
    (CROSS, {"shrinkage": 1.5}, "auto, or a number from 0 to 1"),
    (np.zeros(5), {}, "takes a matrix of vectors"),
])
def test_bad_inputs_are_refused_in_one_line(vectors, kwargs, reason):
    with pytest.raises(WhiteningError, match=reason):
        fit_whitening(vectors, **kwargs)


def test_bad_pairs_are_refused_in_one_line():
    with pytest.raises(WhiteningError, match="at least 2 pairs of 2-dimensional vectors"):
        fit_pair_whitening(CROSS, np.zeros((2, 3)), np.ones((2, 3)))
    with pytest.raises(WhiteningError, match="span fewer than 2 dimensions with no shrinkage"):
        fit_pair_whitening(CROSS, np.zeros((2, 2)), np.array([[0.0, 0.5], [0.0, -0.5]]), shrinkage=0.0)
