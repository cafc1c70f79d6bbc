"""pf.transforms.adaptive_layers against sentence-transformers' AdaptiveLayerLoss (issue 32).

A tiny randomly initialised BERT (3 layers, width 32, a word-level tokenizer built in memory; no
download) runs sentence-transformers' ``AdaptiveLayerLoss(model, MultipleNegativesRankingLoss)``
on batches of pairs and triplets; pmlfunc's ``adaptive_layers(multiple_negatives_ranking)``
gets the same model's mean-pooled hidden states (``output_hidden_states=True``, the embedding
layer's output first, the last layer last) and must give the same value and the same gradients
into every parameter, in float64. sentence-transformers' layer ``i`` is ``hidden_states[i]`` (0: the
embedding layer's output), the index ``layer_weighting`` reads, and its ``n_layers_per_step``
sample is reproduced by passing the sampled layers with their ``layer_indices``.
"""

from __future__ import annotations

import contextlib
import inspect
import random

import pytest
import torch

import pmlfunc as pf

st = pytest.importorskip(
    "sentence_transformers",
    reason="sentence-transformers is not installed (pip install sentence-transformers)",
)

try:  # sentence-transformers >= 6
    from sentence_transformers.sentence_transformer import losses as st_losses
    from sentence_transformers.sentence_transformer import modules as st_modules
except ImportError:  # older releases
    from sentence_transformers import losses as st_losses
    from sentence_transformers import models as st_modules

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
GRAD_TOL = {"rtol": 1e-9, "atol": 1e-11}
N_HIDDEN = 3  # transformer layers: hidden_states has N_HIDDEN + 1 entries, N_HIDDEN prior layers
WIDTH = 32

ANCHORS = [
    "the cat sat on the mat",
    "a dog ran fast",
    "big red car",
    "the small house",
    "blue tree",
    "slow dog sat",
]
POSITIVES = [
    "a cat on a mat",
    "the dog ran",
    "red car big",
    "small house the",
    "a blue tree",
    "the dog was slow",
]
NEGATIVES = [
    "the house sat",
    "a red tree",
    "small slow cat",
    "big blue car",
    "the dog on the mat",
    "fast car ran",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved random BERT and a word-level tokenizer: the model sentence-transformers loads."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_bert")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w for text in ANCHORS + POSITIVES + NEGATIVES for w in text.split()})
    vocab = {w: i for i, w in enumerate(special + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(path)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=WIDTH,
        num_hidden_layers=N_HIDDEN,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertModel(config).save_pretrained(path)
    return str(path)


def _model(model_dir, normalize=False):
    transformer = st_modules.Transformer(model_dir)
    mods = [transformer, st_modules.Pooling(WIDTH, pooling_mode="mean")]
    if normalize:
        mods.append(st_modules.Normalize())
    model = st.SentenceTransformer(modules=mods, device="cpu").to(F64)
    model.eval()  # no dropout anyway (probabilities 0); eval for good measure
    return model


@pytest.fixture(scope="module")
def model(model_dir):
    return _model(model_dir)


@pytest.fixture(scope="module")
def normalized_model(model_dir):
    return _model(model_dir, normalize=True)


def _features(model, texts):
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    return preprocess(texts)


def _columns(model, with_negatives):
    texts = [ANCHORS, POSITIVES] + ([NEGATIVES] if with_negatives else [])
    return [_features(model, t) for t in texts]


def _layer_embeddings(model, features, normalize):
    """Every layer's mean-pooled output, ``hidden_states[0]`` (the embedding layer) first."""
    bert = model[0].auto_model
    inputs = {
        k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in features
    }
    hidden = bert(**inputs, output_hidden_states=True).hidden_states
    assert len(hidden) == N_HIDDEN + 1
    mask = features["attention_mask"].unsqueeze(-1).to(F64)
    pooled = [(h * mask).sum(1) / mask.sum(1) for h in hidden]
    return [torch.nn.functional.normalize(e, dim=-1) for e in pooled] if normalize else pooled


def _value_and_grads(model, compute):
    model.zero_grad(set_to_none=True)
    value = compute()
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def _assert_same(got, want):
    (value, grads), (value_w, grads_w) = got, want
    assert value.dtype == F64
    torch.testing.assert_close(value, value_w, **TOL)
    assert grads.keys() == grads_w.keys()
    assert len(grads) > 10  # the gradients reach the embeddings and every layer
    for name in grads:
        torch.testing.assert_close(
            grads[name], grads_w[name], **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@contextlib.contextmanager
def _seeded(seed):
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def _st_value(model, loss, columns):
    return _value_and_grads(model, lambda: loss([dict(c) for c in columns], None))


def _pf_value(model, loss, columns, normalize=False, picked=None, **kwargs):
    def compute():
        layered = [_layer_embeddings(model, c, normalize) for c in columns]
        if picked is None:
            return loss(*layered, **kwargs)
        keep = [*picked, N_HIDDEN]  # the sampled prior layers, then the last one
        return loss(
            *[[layers[i] for i in keep] for layers in layered], layer_indices=keep, **kwargs
        )

    return _value_and_grads(model, compute)


def _quarter(i):
    return 1.0 / (1.0 + 0.25 * i)


CONFIGS = {
    "defaults": ({}, {}),
    "log-weights": (
        {
            "layer_weighting": "log",
            "last_layer_weight": 0.7,
            "prior_layers_weight": 1.3,
            "kl_div_weight": 2.0,
            "kl_temperature": 0.5,
        },
        {
            "layer_weighting": "log",
            "last_layer_weight": 0.7,
            "prior_layers_weight": 1.3,
            "kl_weight": 2.0,
            "temperature": 0.5,
        },
    ),
    "linear-no-kl": (
        {"layer_weighting": "linear", "kl_temperature": 0.0},
        {"layer_weighting": "linear", "temperature": 0.0},
    ),
    "callable-kl-weight-0": (
        {"layer_weighting": _quarter, "kl_div_weight": 0.0},
        {"layer_weighting": _quarter, "kl_weight": 0.0},
    ),
}


@pytest.mark.parametrize("with_negatives", [False, True], ids=["pairs", "triplets"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_layer_equals_adaptive_layer_loss(model, config, with_negatives):
    """``n_layers_per_step=-1`` (every prior layer each step) against pmlfunc given all layers."""
    st_kwargs, pf_kwargs = CONFIGS[config]
    columns = _columns(model, with_negatives)
    mnrl = st_losses.MultipleNegativesRankingLoss(model)
    want = _st_value(
        model, st_losses.AdaptiveLayerLoss(model, mnrl, n_layers_per_step=-1, **st_kwargs), columns
    )
    loss = pf.transforms.adaptive_layers(pf.losses.multiple_negatives_ranking, **pf_kwargs)
    _assert_same(_pf_value(model, loss, columns), want)


def test_kl_reads_the_embeddings_after_every_module(normalized_model):
    """With a Normalize module after the pooling, the base loss and the KL term both read the
    normalised embeddings: pmlfunc given the normalised layers agrees, the raw ones do not."""
    model = normalized_model
    columns = _columns(model, with_negatives=False)
    mnrl = st_losses.MultipleNegativesRankingLoss(model)
    want = _st_value(model, st_losses.AdaptiveLayerLoss(model, mnrl, n_layers_per_step=-1), columns)
    loss = pf.transforms.adaptive_layers(pf.losses.multiple_negatives_ranking)
    _assert_same(_pf_value(model, loss, columns, normalize=True), want)
    raw, _ = _pf_value(model, loss, columns, normalize=False)  # MNRL is cosine: only the KL moves
    assert not torch.allclose(raw, want[0], rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("n_layers_per_step", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 4, 5])
def test_sampled_layers_equal_layer_indices(model, n_layers_per_step, seed):
    """``n_layers_per_step=k`` draws ``random.sample(range(L - 1), k)``; pmlfunc given those
    layers (and the last) with their ``layer_indices`` gives the same step. The seeds sample
    [1], [0], [0], [2] (k = 1) and [1, 2], [0, 2], [0, 1], [2, 1] (k = 2)."""
    columns = _columns(model, with_negatives=False)
    mnrl = st_losses.MultipleNegativesRankingLoss(model)
    st_loss = st_losses.AdaptiveLayerLoss(
        model, mnrl, n_layers_per_step=n_layers_per_step, layer_weighting="linear"
    )
    with _seeded(seed):
        picked = random.sample(range(N_HIDDEN), n_layers_per_step)
    with _seeded(seed):
        want = _st_value(model, st_loss, columns)
    loss = pf.transforms.adaptive_layers(
        pf.losses.multiple_negatives_ranking, layer_weighting="linear"
    )
    _assert_same(_pf_value(model, loss, columns, picked=picked), want)
    # all the prior layers instead of the sample is another value (the sample matters)
    every, _ = _pf_value(model, loss, columns)
    assert not torch.allclose(every, want[0], rtol=1e-6, atol=0.0)


def test_matryoshka_2d_equals_composition(model):
    """``Matryoshka2dLoss`` (every layer, every width) is
    ``adaptive_layers(matryoshka(loss, dims, normalize=True))``: the KL term at full width."""
    dims, weights = (32, 16, 8), (1.0, 0.5, 0.25)
    columns = _columns(model, with_negatives=True)
    mnrl = st_losses.MultipleNegativesRankingLoss(model)
    st_loss = st_losses.Matryoshka2dLoss(
        model,
        mnrl,
        list(dims),
        matryoshka_weights=list(weights),
        n_layers_per_step=-1,
        n_dims_per_step=-1,
        layer_weighting="log",
    )
    want = _st_value(model, st_loss, columns)
    nested = pf.transforms.matryoshka(
        pf.losses.multiple_negatives_ranking, dims, weights, normalize=True
    )
    loss = pf.transforms.adaptive_layers(nested, layer_weighting="log")
    _assert_same(_pf_value(model, loss, columns), want)


def test_defaults_agree_but_for_the_layer_sample():
    """The weights, temperature and weighting default alike (under other names); the class
    samples one prior layer a step by default, pmlfunc trains every layer it is given."""
    theirs = inspect.signature(st_losses.AdaptiveLayerLoss).parameters
    ours = inspect.signature(pf.transforms.adaptive_layers).parameters
    names = {
        "last_layer_weight": "last_layer_weight",
        "prior_layers_weight": "prior_layers_weight",
        "kl_div_weight": "kl_weight",
        "kl_temperature": "temperature",
        "layer_weighting": "layer_weighting",
    }
    for their_name, our_name in names.items():
        assert theirs[their_name].default == ours[our_name].default, their_name
    assert theirs["n_layers_per_step"].default == 1
