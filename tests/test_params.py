"""Parameter trees: validation, PML initialisation schemes, optree utilities."""

from __future__ import annotations

import math

import pytest
import torch

from pmlfunc import params as P


def test_check_accepts_and_returns_the_tensor():
    emb = torch.randn(4, 8)
    w = torch.randn(3, 8)
    assert P.check({"weight": w}, "weight", emb) is w
    w3 = torch.randn(3, 2, 8)
    assert P.check({"weight": w3}, "weight", emb, ndim=3) is w3


@pytest.mark.parametrize(
    "params,err,match",
    [
        ([torch.randn(3, 8)], TypeError, "params must be a dict"),
        ({"proxies": torch.randn(3, 8)}, ValueError, "no 'weight' entry"),
        ({"weight": 1.0}, TypeError, r"params\['weight'\] must be a tensor"),
        ({"weight": torch.ones(3, 8, dtype=torch.long)}, TypeError, "floating point"),
        ({"weight": torch.randn(3, 2, 8)}, ValueError, r"\(num_classes, embedding_size\)"),
        ({"weight": torch.randn(3, 5)}, ValueError, "embedding size 5 but embeddings have 8"),
    ],
)
def test_check_errors_name_the_argument(params, err, match):
    with pytest.raises(err, match=match):
        P.check(params, "weight", torch.randn(4, 8))


def test_class_labels_eager_range_check():
    P.class_labels(torch.tensor([0, 2, 1]), 3)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\).*\[0, 3\]"):
        P.class_labels(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="labels must be in"):
        P.class_labels(torch.tensor([-1, 0]), 3)
    # Inside torch.func transforms it reads no values (it would break vmap), so it is a no-op.
    torch.func.vmap(lambda y: P.class_labels(y, 3) or y.sum())(torch.tensor([[0, 5]]))
    # Meta tensors have no values.
    P.class_labels(torch.empty(4, dtype=torch.long, device="meta"), 3)


@pytest.mark.compile
def test_class_labels_is_a_no_op_under_compile():
    torch._dynamo.reset()

    def f(y):
        P.class_labels(y, 3)
        return y * 2

    out = torch.compile(f, fullgraph=True)(torch.tensor([0, 7]))
    assert out.tolist() == [0, 14]


def test_init_normal_matches_torch_init_and_generator():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = P.init_normal((100, 64), generator=g1)
    ref = torch.empty(100, 64)
    torch.nn.init.normal_(ref, generator=g2)
    torch.testing.assert_close(a, ref)
    b = P.init_normal((100, 64), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert b.dtype == torch.float64
    assert torch.equal(b.float(), a)  # sampled in float32: the same values in every dtype


def test_init_kaiming_uniform_bound_equals_torch():
    shape, fan_in = (64, 30), 30
    a = P.init_kaiming_uniform(shape, fan_in=fan_in, generator=torch.Generator().manual_seed(0))
    ref = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(ref, a=math.sqrt(5), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a, ref)


def test_init_rejects_bad_sizes():
    with pytest.raises(ValueError, match="positive integers"):
        P.init_normal((0, 4))
    with pytest.raises(ValueError, match="positive integers"):
        P.init_normal((2.0, 4))  # type: ignore[arg-type]


def test_tree_tools():
    tree = {"weight": torch.randn(3, 4), "scale": torch.tensor(2.0), "steps": torch.tensor(5)}
    assert P.count(tree) == 14
    half = P.tree_cast(tree, torch.float16)
    assert half["weight"].dtype == torch.float16 and half["steps"].dtype == torch.int64
    assert tree["weight"].dtype == torch.float32  # never in place
    flat, unflatten = P.tree_flatten({"a": tree["weight"], "b": tree["scale"]})
    assert flat.shape == (13,)
    back = unflatten(flat * 2)
    torch.testing.assert_close(back["a"], tree["weight"] * 2)
    torch.testing.assert_close(back["b"], tree["scale"] * 2)
    for wrong in (flat[:-1], torch.cat([flat, flat]), flat.view(1, -1)):  # (cut silently before)
        with pytest.raises(ValueError, match="1-D vector of the tree's 13 entries"):
            unflatten(wrong)
