"""Tiny random-init model fixtures and their golden logits, made with `transformers`.

usage: make_model_fixtures.py [MINILM_DIR] [--out tests/fixtures]

For each architecture lakeml implements, writes `OUT/models/<name>/`:
  config.json, model.safetensors   AutoModelForSequenceClassification.from_config(cfg), every
                                   parameter then set to seeded random values (see perturb),
                                   saved with save_pretrained (keys carry the HF prefix).
  golden.safetensors               input_ids [B,T] int64, attention_mask [B,T] int64 (rows of
                                   different lengths, right-padded with pad_token_id, one row
                                   full, one of length 2) and logits [B,num_labels] float32 from
                                   model.eval() under torch.no_grad(), fp32, eager attention.
And `OUT/minilm/golden.safetensors`: the real MiniLM (MINILM_DIR, default
$LAKEML_ASSETS/all-MiniLM-L6-v2) as BertForSequenceClassification with a seeded random head
(classifier.weight, classifier.bias stored alongside), on 6 real sentences.

Every run is deterministic (seeded), so regenerating rewrites identical tensors.
"""
import argparse
import os
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForSequenceClassification,
)

NUM_LABELS = 3
# Tiny on purpose: the fixtures are committed.
VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE, MAX_POS = 512, 32, 2, 4, 37, 64
# Row lengths of the golden batch: one full row (no padding), one of length 2, and lengths
# past 16 so that DeBERTa's log buckets (position_buckets 16, mid 8) and its clamping of
# relative positions to +-max_relative_positions (8 in deberta-v2) are both exercised.
LENGTHS = [30, 17, 2, 23]

DROPOUTS = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

DEBERTA_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    intermediate_size=INTERMEDIATE,
    max_position_embeddings=MAX_POS,
    pad_token_id=0,
    layer_norm_eps=1e-7,
    initializer_range=0.02,
    pooler_dropout=0.1,
    **DROPOUTS,
)

CONFIGS = {
    "bert": dict(
        model_type="bert",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POS,
        type_vocab_size=2,
        pad_token_id=0,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        classifier_dropout=None,
        **DROPOUTS,
    ),
    "roberta": dict(
        model_type="roberta",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        # RoBERTa's positions start at pad_token_id + 1, so it needs pad + 1 + T <= this.
        max_position_embeddings=MAX_POS,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        **DROPOUTS,
    ),
    "distilbert": dict(
        model_type="distilbert",
        vocab_size=VOCAB,
        dim=HIDDEN,
        n_layers=LAYERS,
        n_heads=HEADS,
        hidden_dim=INTERMEDIATE,
        max_position_embeddings=MAX_POS,
        pad_token_id=0,
        activation="gelu",
        sinusoidal_pos_embds=False,
        dropout=0.1,
        attention_dropout=0.1,
        seq_classif_dropout=0.2,
    ),
    # DeBERTa-v3 style (microsoft/deberta-v3-base's options), with few buckets so that
    # bucketing is exercised at T <= 30.
    "deberta-v3": dict(
        model_type="deberta-v2",
        relative_attention=True,
        position_buckets=16,
        max_relative_positions=-1,
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        pos_att_type=["p2c", "c2p"],
        position_biased_input=False,
        type_vocab_size=0,
        hidden_act="gelu",
        **DEBERTA_COMMON,
    ),
    # The other paths: no buckets but a small max_relative_positions (clamping), separate
    # position projections (c2p only), absolute positions added to the input, token types,
    # a factorized embedding (embedding_size != hidden_size, embed_proj), the ConvLayer of
    # deberta-v2-xlarge (with groups), cls_dropout, and other activations. ("c2p" as a string
    # is the legacy form; save_pretrained writes it back as a list.)
    "deberta-v2": dict(
        model_type="deberta-v2",
        relative_attention=True,
        position_buckets=-1,
        max_relative_positions=8,
        norm_rel_ebd="none",
        share_att_key=False,
        pos_att_type="c2p",
        position_biased_input=True,
        type_vocab_size=2,
        embedding_size=24,
        conv_kernel_size=3,
        conv_groups=2,
        conv_act="gelu",
        hidden_act="gelu_new",
        pooler_hidden_act="tanh",
        cls_dropout=0.15,
        **DEBERTA_COMMON,
    ),
}


def golden_inputs(pad_token_id: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids in [5, VOCAB) (never the pad id), right-padded to the longest row."""
    t = max(LENGTHS)
    input_ids = torch.full((len(LENGTHS), t), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(LENGTHS), t), dtype=torch.int64)
    for row, n in enumerate(LENGTHS):
        input_ids[row, :n] = torch.randint(5, VOCAB, (n,), generator=generator)
        attention_mask[row, :n] = 1
    assert pad_token_id < 5
    return input_ids, attention_mask


def perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every parameter a distinctive random value.

    HF's init leaves biases at 0 and LayerNorm weights at 1 (a loader that skipped them would
    still match) and, at std 0.02, gives logits of ~0.01 (a 1e-4 tolerance would then be a
    loose 1%). After this, each tensor differs from its default and logits are O(1).
    """
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.dim() >= 2:
                p.copy_(noise * 0.2)
            elif p.abs().sum() == 0:  # biases
                p.copy_(noise * 0.1)
            else:  # LayerNorm weights
                p.copy_(1.0 + noise * 0.1)


def make_model(name: str, spec: dict, out: Path, seed: int) -> None:
    spec = dict(spec)
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, num_labels=NUM_LABELS, **spec)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager")
    perturb(model, torch.Generator().manual_seed(seed))
    model.eval()

    d = out / "models" / name
    if d.exists():
        shutil.rmtree(d)
    model.save_pretrained(d, safe_serialization=True)

    generator = torch.Generator().manual_seed(seed)
    input_ids, attention_mask = golden_inputs(cfg.pad_token_id, generator)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        # The saved checkpoint, not just the in-memory model, must give these logits.
        reloaded = AutoModelForSequenceClassification.from_pretrained(d, attn_implementation="eager").eval()
        again = reloaded(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        assert torch.equal(logits, again), f"{name}: reloaded checkpoint gives other logits"
    save_file(
        {"input_ids": input_ids, "attention_mask": attention_mask, "logits": logits.contiguous()},
        d / "golden.safetensors",
    )
    print(f"{name}: {type(model).__name__}, logits {tuple(logits.shape)} -> {d}")


SENTENCES = [
    "A gripping, beautifully acted film that stays with you long after the credits roll.",
    "The plot is a mess and the jokes never land.",
    "Not bad.",
    "I expected more from a director of this caliber, but the second half redeems it somewhat.",
    "Lakehouse tables keep the training data and the predictions side by side.",
    "Why would anyone sit through two hours of this?",
]


def make_minilm(minilm_dir: Path, out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    model, info = BertForSequenceClassification.from_pretrained(
        minilm_dir, num_labels=2, attn_implementation="eager", output_loading_info=True
    )
    # Only the fresh head may be missing: the encoder must come from the checkpoint.
    missing = [k for k in info["missing_keys"] if not k.startswith("classifier.")]
    if missing:
        raise SystemExit(f"{minilm_dir}: weights not in the checkpoint: {missing}")
    generator = torch.Generator().manual_seed(seed)
    head = {
        "classifier.weight": torch.randn(2, model.config.hidden_size, generator=generator) * 0.02,
        "classifier.bias": torch.randn(2, generator=generator) * 0.02,
    }
    with torch.no_grad():
        model.classifier.weight.copy_(head["classifier.weight"])
        model.classifier.bias.copy_(head["classifier.bias"])
    model.eval()

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    enc = tok(SENTENCES, padding=True, truncation=True, max_length=128, return_tensors="pt")
    input_ids = enc["input_ids"].to(torch.int64)
    attention_mask = enc["attention_mask"].to(torch.int64)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()

    d = out / "minilm"
    d.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            **head,
            "input_ids": input_ids.contiguous(),
            "attention_mask": attention_mask.contiguous(),
            "logits": logits.contiguous(),
        },
        d / "golden.safetensors",
    )
    print(f"minilm: logits {tuple(logits.shape)} -> {d}")


def main() -> None:
    default_minilm = Path(os.environ.get("LAKEML_ASSETS", "")) / "all-MiniLM-L6-v2"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("minilm_dir", nargs="?", type=Path, default=default_minilm)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "fixtures")
    args = parser.parse_args()
    if not (args.minilm_dir / "config.json").is_file():
        raise SystemExit(f"{args.minilm_dir}: no MiniLM here (give its directory, or set LAKEML_ASSETS)")

    torch.use_deterministic_algorithms(True)
    for seed, (name, spec) in enumerate(CONFIGS.items()):
        make_model(name, spec, args.out, seed=1000 + seed)
    make_minilm(args.minilm_dir, args.out, seed=7)

    readme = args.out / "models" / "README.md"
    readme.write_text(
        f"Tiny random-init models (seeded) with golden logits, made with transformers {transformers.__version__}"
        f" and torch {torch.__version__.split('+')[0]} (fp32, eager attention, eval, no_grad).\n"
        "Made by tests/py/make_model_fixtures.py, which also writes ../minilm/golden.safetensors.\n"
        "Regenerate: `source scripts/env.sh && \"$LAKEML_PYTHON\" tests/py/make_model_fixtures.py`\n"
    )


if __name__ == "__main__":
    main()
