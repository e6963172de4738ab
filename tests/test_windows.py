"""The sliding-window plan: coverage, context and shape, for many stream lengths, windows and strides."""

import pytest

from tasks.core.errors import InputError
from tasks.engine.windows import plan_windows

CASES = [(n, L, S) for n in (2, 3, 5, 17, 100, 257, 1000, 1023) for L, S in
         ((4, 1), (4, 3), (8, 4), (16, 5), (16, 15), (64, 32), (64, 63), (128, 64), (2000, 1000))]


@pytest.mark.parametrize("first_scored", [0, 1])
@pytest.mark.parametrize("n,window,stride", CASES)
def test_every_token_after_the_first_is_scored_once(n, window, stride, first_scored):
    windows = plan_windows(n, window, stride, first_scored)
    scored = [q for w in windows for q in range(w.first_scored, w.end)]
    assert scored == list(range(first_scored, n))
    assert sum(w.n_scored for w in windows) == n - first_scored


@pytest.mark.parametrize("n,window,stride", CASES)
def test_windows_end_on_the_stride_and_keep_full_context(n, window, stride):
    for k, w in enumerate(plan_windows(n, window, stride)):
        assert w.index == k
        assert w.end == min(window + k * stride, n)
        assert w.start == max(0, w.end - window)  # as much context as the window holds
        assert w.end - w.start <= window
        if k > 0:
            assert w.n_scored <= stride
            assert w.first_scored > w.start  # a scored token always has context in its window


@pytest.mark.parametrize("stride", [0, -1, 8, 9])
def test_bad_stride_is_refused(stride):
    with pytest.raises(InputError, match="stride"):
        plan_windows(100, 8, stride)
