"""Tests for the centroid-similarity losses of ``pmlfunc.losses.centroids`` (GE2E).

``ge2e`` is checked against a float64 loop reference written from the paper
(tests/reference/centroids.py): values and full gradients (embeddings, ``w``, ``b``) on several
label layouts (the paper's equal class sizes, unequal sizes, singletons, one class, no class
with two members, arbitrary label values), both variants, both reductions, both slot modes
(``num_classes``). Also: the bias cancels exactly in the softmax variant (a zero gradient, no
precision lost however large ``b``), the clamp of ``w``, large scales, invariances, NaN/inf
propagation, low precision, ``vmap``, bad input and ``ge2e_init``. The properties every loss
keeps (gradcheck, ``torch.func.grad``, ``torch.compile(fullgraph=True)``, the meta device, a
docstring example, non-finite inputs, duplicate rows, autocast) run over the registry entries
``ge2e``, ``ge2e[contrast]`` and ``ge2e[num_classes]`` in test_conformance.py.

PML 3's ``GE2ELoss`` is not installable here (PML 2.9.0 has no GE2E), so there is no PML parity
test: the reference is the paper.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import assert_same, lab, randn, value_and_grads
from reference import centroids as ref

import pmlfunc as pf
from pmlfunc.losses import ge2e, ge2e_init

F64, F32 = torch.float64, torch.float32
TOL: dict[str, Any] = {"rtol": 1e-10, "atol": 1e-12}
D = 5
LAYOUTS = {
    "paper_4x3": [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],  # N speakers × M utterances, in blocks
    "paper_3x4_shuffled": [2, 0, 1, 1, 2, 0, 0, 2, 1, 0, 1, 2],
    "unequal_with_singletons": [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4],  # 2 and 4 alone
    "pairs": [0, 0, 1, 1, 2, 2],  # M = 2: the exclusive centroid is the other row
    "one_class": [3, 3, 3, 3],
    "all_singletons": [0, 1, 2, 3],  # no embedding has a loss: 0
    "one_row": [7],
    "any_label_values": [7, -3, 7, 100, -3, 100, 100, 5],
}
VARIANTS = ["softmax", "contrast"]


def _draw(layout, seed=0, dtype=F64, w=10.0, b=-5.0):
    g = torch.Generator().manual_seed(seed)
    y = lab(LAYOUTS[layout] if isinstance(layout, str) else layout)
    emb = randn(g, y.shape[0], D, dtype=dtype)
    return emb, y, torch.tensor(w, dtype=F64), torch.tensor(b, dtype=F64)


def _ours(y, **kw):
    return lambda e, w, b: ge2e(e, y, {"w": w, "b": b}, **kw)


def _terms(emb, y, params, **kw) -> Any:
    """The unreduced terms (the ``none()`` reducer): ``{"loss": {"losses", "weights", ...}}``."""
    return ge2e(emb, y, params, reducer=pf.reducers.none(), **kw)


def _ref(y, **kw):
    return lambda e, w, b: ref.ge2e(e, y, w, b, **kw)


# ----------------------------------------------------------------------------------------------
# the reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_value_and_gradients_equal_the_float64_reference(layout, variant):
    emb, y, w, b = _draw(layout)
    got = value_and_grads(_ours(y, variant=variant), emb, w, b)
    want = value_and_grads(_ref(y, variant=variant), emb, w, b)
    assert_same(got, want, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["paper_4x3", "unequal_with_singletons", "any_label_values"])
def test_the_sum_reducer_gives_the_papers_sum(layout, variant):
    emb, y, w, b = _draw(layout, seed=1)
    got = value_and_grads(_ours(y, variant=variant, reducer=pf.reducers.sum()), emb, w, b)
    want = value_and_grads(_ref(y, variant=variant, reduction="sum"), emb, w, b)
    assert_same(got, want, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("w, b", [(1.0, 0.0), (3.0, 2.0), (25.0, -12.0), (0.2, 7.0)])
def test_other_scales_and_biases_equal_the_reference(w, b, variant):
    emb, y, wt, bt = _draw("unequal_with_singletons", seed=2, w=w, b=b)
    got = value_and_grads(_ours(y, variant=variant), emb, wt, bt)
    want = value_and_grads(_ref(y, variant=variant), emb, wt, bt)
    assert_same(got, want, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["paper_4x3", "unequal_with_singletons", "one_class"])
def test_num_classes_slots_equal_the_sorted_label_slots(layout, variant):
    """Labels as class ids in ``[0, num_classes)`` (absent ids are empty slots) give the same
    loss and gradients as the slots from sorting the labels."""
    emb, y, w, b = _draw(layout, seed=3)
    want = value_and_grads(_ours(y, variant=variant), emb, w, b)
    for num_classes in (int(y.max()) + 1, int(y.max()) + 4):
        got = value_and_grads(_ours(y, variant=variant, num_classes=num_classes), emb, w, b)
        assert_same(got, want, **TOL)


# ----------------------------------------------------------------------------------------------
# what the definition says
# ----------------------------------------------------------------------------------------------
def test_softmax_bias_cancels_exactly_with_a_zero_gradient():
    """``b`` is added to every logit of a row: the softmax loss does not depend on it (the same
    bits for any finite b) and its gradient is exactly zero."""
    emb, y, w, _ = _draw("unequal_with_singletons", seed=4)
    values = []
    for b in (-5.0, 0.0, 3.5, 1e6):
        value, (_, _, g_b) = value_and_grads(_ours(y), emb, w, torch.tensor(b, dtype=F64))
        assert torch.equal(g_b, torch.zeros_like(g_b))
        values.append(value)
    assert all(torch.equal(v, values[0]) for v in values)


def test_contrast_bias_has_a_gradient():
    emb, y, w, b = _draw("paper_4x3", seed=4)
    _, (_, _, g_b) = value_and_grads(_ours(y, variant="contrast"), emb, w, b)
    assert g_b.abs() > 1e-6


def test_softmax_loses_no_precision_to_a_large_bias_in_float32():
    """The cross entropy is taken over ``w·cos`` alone, so a bias of 1e5 costs nothing in
    float32 (adding it to the logits first would round them at ~1e5·2⁻²⁴ ≈ 6e-3)."""
    emb, y, w, _ = _draw("paper_4x3", seed=5)
    want = ref.ge2e(emb, y, w, torch.tensor(0.0, dtype=F64))
    params = {"w": w.float(), "b": torch.tensor(1e5)}
    got = ge2e(emb.float(), y, params)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_large_scale_gives_finite_values_equal_to_the_reference(variant):
    emb, y, w, b = _draw("unequal_with_singletons", seed=6, w=500.0, b=-40.0)
    got = value_and_grads(_ours(y, variant=variant), emb, w, b)
    want = value_and_grads(_ref(y, variant=variant), emb, w, b)
    assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in got[1])
    assert_same(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_w_is_clamped_at_1e_6_with_a_zero_gradient_below(variant):
    emb, y, _, b = _draw("paper_4x3", seed=7)
    at_bound = ge2e(emb, y, {"w": torch.tensor(1e-6, dtype=F64), "b": b}, variant=variant)
    for w in (-3.0, 0.0, 1e-9):
        value, (_, g_w, _) = value_and_grads(
            _ours(y, variant=variant), emb, torch.tensor(w, dtype=F64), b
        )
        assert torch.equal(value, at_bound)
        assert torch.equal(g_w, torch.zeros_like(g_w))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_singleton_is_left_out_but_its_centroid_still_scores_the_others(variant):
    """Adding a singleton class: its own row gets no gradient through its (absent) term but
    through the others' scores against its centroid; the others' losses change."""
    emb, y, w, b = _draw([0, 0, 0, 1, 1, 1, 2], seed=8)
    without = ge2e(emb[:6], y[:6], {"w": w, "b": b}, variant=variant)
    value, (g_emb, _, _) = value_and_grads(_ours(y, variant=variant), emb, w, b)
    terms = _terms(emb, y, {"w": w, "b": b}, variant=variant)
    assert terms["loss"]["weights"].tolist() == [1.0] * 6 + [0.0]
    assert not torch.allclose(value, without)
    assert g_emb[6].abs().max() > 0  # through the other rows' scores against class 2


def test_one_class_softmax_is_zero_and_contrast_pulls_to_the_own_centroid():
    emb, y, w, b = _draw("one_class", seed=9)
    value, (g_emb, _, _) = value_and_grads(_ours(y), emb, w, b)
    assert value == 0 and torch.equal(g_emb, torch.zeros_like(g_emb))
    value, (g_emb, _, _) = value_and_grads(_ours(y, variant="contrast"), emb, w, b)
    assert value > 0 and g_emb.abs().max() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_class_with_two_members_gives_zero_and_zero_gradients(variant):
    emb, y, w, b = _draw("all_singletons", seed=10)
    value, grads = value_and_grads(_ours(y, variant=variant), emb, w, b)
    assert value == 0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("variant", VARIANTS)
def test_permuting_rows_renaming_classes_and_rescaling_rows_leave_the_loss_unchanged(variant):
    emb, y, w, b = _draw("unequal_with_singletons", seed=11)
    params = {"w": w, "b": b}
    want = ge2e(emb, y, params, variant=variant)
    g = torch.Generator().manual_seed(0)
    p = torch.randperm(y.shape[0], generator=g)
    renamed = torch.tensor([40, -2, 7, 0, 9])[y]
    scaled = emb * torch.rand(y.shape[0], 1, generator=g, dtype=F64).add(0.1).mul(10)
    for e, labels in ((emb[p], y[p]), (emb, renamed), (scaled, y)):
        torch.testing.assert_close(ge2e(e, labels, params, variant=variant), want, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_class_weighted_weights_each_embedding_by_its_label(variant):
    emb, y, w, b = _draw("unequal_with_singletons", seed=12)
    weights = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5], dtype=F64)
    got = ge2e(
        emb, y, {"w": w, "b": b}, variant=variant, reducer=pf.reducers.class_weighted(weights)
    )
    terms = _terms(emb, y, {"w": w, "b": b}, variant=variant)["loss"]
    kept = terms["weights"]
    want = (weights[y] * terms["losses"] * kept).sum() / kept.sum()
    torch.testing.assert_close(got, want, **TOL)


def test_embedding_regularizer_is_added():
    emb, y, w, b = _draw("paper_4x3", seed=13)
    params = {"w": w, "b": b}
    reg = pf.regularizers.lp
    got = ge2e(emb, y, params, embedding_regularizer=reg, embedding_reg_weight=0.3)
    torch.testing.assert_close(got, ge2e(emb, y, params) + 0.3 * reg(emb), **TOL)


# ----------------------------------------------------------------------------------------------
# non-finite numbers, precision, transforms
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("key", ["w", "b"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_w_or_b_makes_the_loss_nan(key, value, variant):
    """Also where a saturated sigmoid would hide it (contrast with w = ±inf)."""
    emb, y, w, b = _draw("paper_4x3", seed=14)
    params = {"w": w, "b": b}
    params[key] = torch.tensor(value, dtype=F64)
    assert torch.isnan(ge2e(emb, y, params, variant=variant))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("row", [0, 5])  # a row with a loss, a singleton left out
def test_a_nan_embedding_makes_the_loss_nan(row, variant):
    emb, y, w, b = _draw("unequal_with_singletons", seed=15)
    emb = emb.clone()
    emb[row, 1] = math.nan
    assert torch.isnan(ge2e(emb, y, {"w": w, "b": b}, variant=variant))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_embeddings_give_a_float32_loss_close_to_float64(dtype, variant):
    emb, y, w, b = _draw("paper_3x4_shuffled", seed=16)
    low = emb.to(dtype)
    params = {"w": w.float(), "b": b.float()}
    got = ge2e(low, y, params, variant=variant)
    want = ref.ge2e(low.double(), y, w, b, variant=variant)
    assert got.dtype == F32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_vmap_over_batches_equals_a_loop(variant):
    emb, y, w, b = _draw("paper_4x3", seed=17)
    params = {"w": w, "b": b}
    stack = torch.stack([emb, emb.flip(0), 2 * emb + 1])

    def f(e):
        return ge2e(e, y, params, variant=variant)

    torch.testing.assert_close(torch.func.vmap(f)(stack), torch.stack([f(e) for e in stack]))


def test_func_grad_over_the_params_dict():
    emb, y, w, b = _draw("paper_4x3", seed=18)
    grads = torch.func.grad(lambda p: ge2e(emb, y, p, variant="contrast"))({"w": w, "b": b})
    _, (_, g_w, g_b) = value_and_grads(_ours(y, variant="contrast"), emb, w, b)
    torch.testing.assert_close(grads["w"], g_w, **TOL)
    torch.testing.assert_close(grads["b"], g_b, **TOL)


# ----------------------------------------------------------------------------------------------
# bad input and the init
# ----------------------------------------------------------------------------------------------
def _ok():
    emb, y, w, b = _draw("paper_4x3")
    return emb, y, {"w": w, "b": b}


@pytest.mark.parametrize(
    "params, error, match",
    [
        ([1.0, 2.0], TypeError, "params must be a dict"),
        ({"w": torch.tensor(10.0, dtype=F64)}, ValueError, "no 'b' entry"),
        ({"b": torch.tensor(1.0, dtype=F64)}, ValueError, "no 'w' entry"),
        ({"w": 10.0, "b": torch.tensor(1.0, dtype=F64)}, TypeError, r"params\['w'\] must be"),
        ({"w": torch.ones(1, dtype=F64), "b": torch.tensor(1.0)}, ValueError, "0-d"),
        ({"w": torch.tensor(10), "b": torch.tensor(1.0)}, TypeError, "floating point"),
        (
            {"w": torch.tensor(1.0), "b": torch.tensor(1.0), "scale": torch.tensor(1.0)},
            ValueError,
            "unknown entries",
        ),
        (
            {"w": torch.tensor(1.0), "b": torch.tensor(1.0, device="meta")},
            ValueError,
            "is on meta",
        ),
    ],
)
def test_bad_params_raise_naming_the_entry(params, error, match):
    emb, y, _ = _ok()
    with pytest.raises(error, match=match):
        ge2e(emb, y, params)


def test_bad_arguments_raise():
    emb, y, params = _ok()
    with pytest.raises(ValueError, match="variant must be one of"):
        ge2e(emb, y, params, variant="triplet")
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\)"):
        ge2e(emb, y, params, num_classes=3)
    with pytest.raises(ValueError, match=r"class ids in \[0, 5\)"):
        ge2e(emb, y - 1, params, num_classes=5)
    with pytest.raises(TypeError, match="num_classes must be an int"):
        ge2e(emb, y, params, num_classes=4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="labels has length"):
        ge2e(emb, y[:-1], params)
    with pytest.raises(TypeError, match="labels must have an integer"):
        ge2e(emb, y.double(), params)
    with pytest.raises(ValueError, match="embeddings must be 2-D"):
        ge2e(emb[0], y, params)
    with pytest.raises(TypeError, match="reducer must be a pmlfunc reducer"):
        ge2e(emb, y, params, reducer="mean")  # type: ignore[arg-type]


def test_init_gives_the_papers_values_and_checks_them():
    p = ge2e_init()
    assert sorted(p) == ["b", "w"] and p["w"].ndim == 0 and p["w"].dtype == F32
    assert (float(p["w"]), float(p["b"])) == (10.0, -5.0)
    p = ge2e_init(3.0, 0.5, dtype=F64)
    assert (float(p["w"]), float(p["b"]), p["b"].dtype) == (3.0, 0.5, F64)
    with pytest.raises(ValueError, match="init_w must be > 0"):
        ge2e_init(init_w=0.0)
    with pytest.raises(TypeError, match="init_b must be a Python number"):
        ge2e_init(init_b=torch.tensor(1.0))  # type: ignore[arg-type]
