"""Keras Hub text backbones on the ghost engine, against brute force.

Tiny backbones built from a config (random weights, nothing downloaded):
width 16, vocabulary 50, 8 tokens, one transformer layer (tracing the ghost
step is most of a test's time), two in the fully trainable GPT-2, so that a
stack of blocks (whose inner layers have the same names) is checked too.
Dropout is 0 so that the per-example loop and the batched pass see the same
function. Tolerances as in tests/brute_force.py (`check`: relative L2 error
1e-5 in float32).
"""

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from brute_force import check, check_vectorized, labels, rng
from keras_dp.clipping import ghost

# Whole private steps, whose kernel-level parts (each layer family's
# per-example gradients, the engines, noise) tests/clipping checks under
# both oneDNN settings: `make test` runs each test, and each parametrized
# case, in one of its two runs (pytest.ini's marker).
pytestmark = pytest.mark.alternating

keras_hub = pytest.importorskip("keras_hub")

VOCAB, SEQ = 50, 8


def gpt2(lora_rank=None, num_layers=1):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout=0.0, max_sequence_length=SEQ)
    if lora_rank:
        backbone.enable_lora(lora_rank)
    return backbone


def bert(lora_rank=None, num_layers=1):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout=0.0, max_sequence_length=SEQ, num_segments=2)
    if lora_rank:
        backbone.enable_lora(lora_rank)
    return backbone


def randomize_lora_b(model):
    """Keras starts LoRA's B at zero (then A's gradient is zero): draw it."""
    for v in model.trainable_variables:
        if "lora_kernel_b" in v.path:
            v.assign(rng(5).normal(size=v.shape).astype("float32") * 0.5)


def token_batch(n=8, segments=False):
    ids = rng().integers(1, VOCAB, size=(n, SEQ)).astype("int32")
    mask = np.ones((n, SEQ), "int32")
    mask[1, 5:] = 0  # Padded examples.
    mask[4, 3:] = 0
    x = {"token_ids": ids * mask, "padding_mask": mask}
    if segments:
        x["segment_ids"] = (np.arange(SEQ)[None] >= 4).astype("int32") * mask
    return x


def gpt2_classifier(backbone):
    """A head on the mean of GPT-2's token states."""
    inputs = {name: keras.Input((SEQ,), dtype="int32", name=name)
              for name in ("token_ids", "padding_mask")}
    pooled = keras.layers.GlobalAveragePooling1D()(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(3)(pooled))


def bert_classifier(backbone):
    return keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None,
                                               dropout=0.0)


# BERT with LoRA is slow (17 s over both oneDNN runs): GPT-2 with LoRA and
# BERT fully trainable cover its layers and LoRA on a backbone.
@pytest.mark.parametrize("backbone, head, segments", [
    (gpt2, gpt2_classifier, False),
    pytest.param(bert, bert_classifier, True, marks=pytest.mark.slow)], ids=["gpt2", "bert"])
def test_backbones_with_lora(backbone, head, segments):
    backbone = backbone(lora_rank=4)
    # enable_lora freezes the backbone but for LoRA's A and B (and the biases
    # of the query and value projections, which Keras leaves trainable).
    assert {v.name for v in backbone.trainable_variables} == {
        "lora_kernel_a", "lora_kernel_b", "bias"}
    model = head(backbone)
    randomize_lora_b(model)
    check(model, {"x": token_batch(segments=segments), "y": labels(8)})


# GPT-2 fully trainable is slow (32 s with oneDNN on): BERT covers the same
# layer families, GPT-2 with LoRA above its blocks (make test-all runs both).
@pytest.mark.parametrize("build, segments", [
    pytest.param(lambda: gpt2_classifier(gpt2(num_layers=2)), False, marks=pytest.mark.slow),
    (lambda: bert_classifier(bert()), True)], ids=["gpt2", "bert"])
def test_backbones_fully_trainable(build, segments):
    # Token, position (and segment) embeddings, LayerNormalization, attention, MLP.
    model = build()
    assert ghost.supports(model)
    # The clipped sum alone: the norms of these layers are compared with LoRA
    # above and per layer family in tests/clipping (a second trace of the
    # backbone here would double the test's time).
    check(model, {"x": token_batch(segments=segments), "y": labels(8)}, norms=False)


def test_causal_lm_with_tied_input_and_output_embeddings():
    # The token table is read twice per example (embedding, then logits):
    # its per-example gradient is the sum of both uses.
    keras.utils.set_random_seed(0)
    model = keras_hub.models.GPT2CausalLM(gpt2(), preprocessor=None)
    assert model.backbone.token_embedding.tie_weights
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def token_mean_loss(batch, y_pred):
        weights = tf.cast(batch["x"]["padding_mask"], y_pred.dtype)
        per_token = loss(batch["y"], y_pred) * weights
        return tf.reduce_sum(per_token, axis=1) / tf.reduce_sum(weights, axis=1)

    x = token_batch()
    y = np.roll(x["token_ids"], -1, axis=1)
    check(model, {"x": x, "y": y}, loss_fn=token_mean_loss, norms=False)


@pytest.mark.slow  # 8 s: the vectorized engine is checked in make test by tests/clipping.
def test_a_masked_lm_runs_the_vectorized_engine_exactly():
    # BertMaskedLM gathers each example's masked positions and scores them
    # against the tied token table plus a bias of its head's own, which has
    # no norm function: ghost clipping refuses it and "auto" runs the
    # vectorized engine, exact here. (Review round 47 measured 1.004 C with
    # dropout, whose masks are drawn per row; its dropout is 0 here.)
    keras.utils.set_random_seed(0)
    model = keras_hub.models.BertMaskedLM(bert(), preprocessor=None)
    assert not ghost.supports(model)
    x = token_batch(segments=True)
    positions = np.sort(rng(2).permutation(SEQ)[:3]) * np.ones((8, 1), "int32")
    y = np.take_along_axis(x["token_ids"], positions, axis=1)
    np.put_along_axis(x["token_ids"], positions, 1, axis=1)  # The mask token.
    x["mask_positions"] = positions.astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    check_vectorized(model, {"x": x, "y": y}, loss_fn=lambda batch, y_pred: tf.reduce_mean(
        loss(batch["y"], y_pred), axis=1))


# About a minute on 2 cores (a GPT-2-shaped backbone traced in a subprocess);
# the backbone tests above check the same layers on the ghost engine, exactly.
@pytest.mark.slow
@pytest.mark.program
def test_finetune_text_example_trains_privately_on_the_ghost_engine():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "finetune_text.py"), "--num_train=500",
         "--num_test=200", "--epochs=1", "--batch_size=100"],
        capture_output=True, text=True, timeout=600, cwd=root,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "clipping engine: ghost" in result.stdout, result.stdout
    match = re.search(r"test accuracy ([0-9.]+) at epsilon ([0-9.]+) ", result.stdout)
    assert match, result.stdout
    assert 0 <= float(match.group(1)) <= 1 and 0 < float(match.group(2)) < float("inf")
