"""tests/lab/models: tiny Llama models that are deterministic, well-shaped, and (one) broken."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jinja2
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from tests.lab.models import make_models
from tests.lab.models.make_models import MODELS, build_model, expected_shapes

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("models")
    return {name: build_model(name, out / name) for name in MODELS}


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="numpy") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_the_lab_models_exist():
    assert {"tiny-a", "tiny-b", "tiny-broken"} <= set(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_same_name_gives_byte_identical_files(built, tmp_path, name):
    again = build_model(name, tmp_path / name)
    assert tree_bytes(again) == tree_bytes(built[name])
    assert sorted(tree_bytes(again)) == sorted(make_models.FILES)


def test_rebuilding_an_identical_folder_leaves_it_untouched(tmp_path):
    folder = build_model("tiny-a", tmp_path / "tiny-a")
    old = time.time() - 3600
    for p in folder.iterdir():
        os.utime(p, (old, old))
    build_model("tiny-a", folder)
    assert all(p.stat().st_mtime == old for p in folder.iterdir())


def test_a_changed_folder_is_rewritten(tmp_path):
    folder = build_model("tiny-a", tmp_path / "m")
    (folder / "config.json").write_text("{}")
    build_model("tiny-a", folder)
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 128


def test_refuses_to_replace_a_folder_with_other_files(tmp_path):
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        build_model("tiny-a", folder)
    assert (folder / "notes.txt").read_text() == "mine"
    assert not (folder / "model.safetensors").exists()


def test_unknown_model_name():
    with pytest.raises(KeyError, match="unknown model"):
        build_model("tiny-z", Path("/nonexistent/never-written"))


@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
def test_weights_match_the_config(built, name):
    cfg = json.loads((built[name] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"]
    assert 32 <= cfg["head_dim"] <= 512            # vLLM's CPU attention
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert header_shapes(built[name] / "model.safetensors") == expected_shapes(cfg)
    with safe_open(str(built[name] / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        emb = f.get_tensor("model.embed_tokens.weight")
    assert str(emb.dtype) == "float32" and 0.01 < float(emb.std()) < 0.03


def test_tiny_b_has_another_shape_than_tiny_a(built):
    a = json.loads((built["tiny-a"] / "config.json").read_text())
    b = json.loads((built["tiny-b"] / "config.json").read_text())
    assert (a["hidden_size"], a["num_hidden_layers"]) != (b["hidden_size"], b["num_hidden_layers"])
    assert (built["tiny-b"] / "model.safetensors").stat().st_size > \
        (built["tiny-a"] / "model.safetensors").stat().st_size


def test_broken_model_is_valid_but_has_one_wrong_shape(built):
    folder = built["tiny-broken"]
    cfg = json.loads((folder / "config.json").read_text())
    good = json.loads((built["tiny-a"] / "config.json").read_text())
    assert cfg == good                      # nothing in the config gives it away
    expected = expected_shapes(cfg)
    actual = header_shapes(folder / "model.safetensors")   # a valid safetensors file
    assert set(actual) == set(expected)
    wrong = {n: (actual[n], expected[n]) for n in expected if actual[n] != expected[n]}
    assert wrong == {"model.layers.1.mlp.down_proj.weight": ((256, 128), (128, 256))}


def test_drifted_model_is_tiny_a_but_for_noise_in_lm_head(built):
    from safetensors.numpy import load_file

    folder, good = built["tiny-a-drifted"], built["tiny-a"]
    assert (folder / "config.json").read_text() == (good / "config.json").read_text()
    assert (folder / "model.safetensors").stat().st_size == (good / "model.safetensors").stat().st_size
    drifted, original = load_file(str(folder / "model.safetensors")), load_file(str(good / "model.safetensors"))
    changed = sorted(n for n in original if not (drifted[n] == original[n]).all())
    assert changed == ["lm_head.weight"]
    # noise of the weights' own size: every logit moves, so greedy answers go another way
    assert 0.015 < float((drifted["lm_head.weight"] - original["lm_head.weight"]).std()) < 0.025


def test_tokenizer_round_trip_and_specials(built):
    folder = built["tiny-a"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "config.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok.get_vocab_size() == cfg["vocab_size"] == 2048    # every id the model emits decodes
    for text in ["The library in our town was built long ago.", "naïve café — 42 €, 東京 🙂",
                 "  leading spaces\nand\ttabs  "]:
        enc = tok.encode(text)
        assert enc.ids[0] == cfg["bos_token_id"]
        assert tok.decode(enc.ids, skip_special_tokens=True) == text
    assert len(tok.encode("The morning train left the station").ids) <= 8   # real merges
    assert tok.token_to_id(tcfg["bos_token"]) == cfg["bos_token_id"]
    assert tok.token_to_id(tcfg["eos_token"]) == cfg["eos_token_id"]
    assert tok.token_to_id(tcfg["pad_token"]) == cfg["pad_token_id"]
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_chat_template_renders_and_tokenizes(built):
    folder = built["tiny-a"]
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert (folder / "chat_template.jinja").read_text().strip() == tcfg["chat_template"]
    prompt = jinja2.Environment().from_string(tcfg["chat_template"]).render(
        messages=[{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
        bos_token=tcfg["bos_token"])
    assert prompt == "<|begin_of_text|><|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert ids[:2] == [tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|im_start|>")]
    assert tok.token_to_id("<|im_end|>") in ids


def test_cli_builds_the_named_models(tmp_path, capsys):
    assert make_models.main(["--out", str(tmp_path), "tiny-b"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-b"]
    assert "tiny-b:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        make_models.main(["--out", str(tmp_path), "nope"])
