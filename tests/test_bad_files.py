"""A damaged file a reader reads (a model's config.json or weight index, tokenizer files, a
run's config.yaml, run_id, wandb.json) is one error naming the file and what is wrong, of
the kind the command line turns into one line, never a traceback."""
import json

import pytest

from async_rl.errors import RunFailure, UsageError


def _hf_config(d, **fields):
    base = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300}
    (d / "config.json").write_text(json.dumps({**base, **fields}))


def _hf_resolve(d):
    from async_rl import config as C
    from async_rl.model import hf
    hf.resolve(C.load("configs/tiny.yaml", [f"model.hf_path={d}", "model.learned_positions=0"]))


def _wandb(d):
    from async_rl.obs.wandb_log import read_state
    read_state(d / "wandb.json")


def _weights(d):
    from async_rl.model.hf import _Checkpoint
    _Checkpoint(d)


def _tokenizer_json(d):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))


def _tokenizer(d):
    from async_rl.data.tokenizer import HFTokenizer
    HFTokenizer(d)


def _run_id(d):
    from async_rl.store.rundir import run_identity
    run_identity(d, create=False)


def _saved_config(d):
    from async_rl.state.saved_run import open_run
    open_run(d)


def _audit(d):
    from async_rl.state.audit import audit
    audit(d)


CASES = {
    "data.json a list": (lambda d: (d / "data.json").write_text("[1]"), _audit, "data.json"),
    "data.json not UTF-8": (lambda d: (d / "data.json").write_bytes(b"\xff{"), _audit, "data.json"),
    "rope_scaling a string": (lambda d: _hf_config(d, rope_scaling="linear"), _hf_resolve, "rope_scaling"),
    "rope_parameters a list": (lambda d: _hf_config(d, rope_parameters=[1]), _hf_resolve, "rope_parameters"),
    "rope factor not a number": (lambda d: _hf_config(d, rope_scaling={"rope_type": "linear", "factor": "x"}),
                                 _hf_resolve, "not a number"),
    "config.json not UTF-8": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{"), _hf_resolve, "config.json"),
    "weight index a list": (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
                            _weights, "model.safetensors.index.json"),
    "weight index not an object": (lambda d: (d / "model.safetensors.index.json").write_text("[1]"),
                                   _weights, "model.safetensors.index.json"),
    "tokenizer.json not a tokenizer": (lambda d: (d / "tokenizer.json").write_text("{}"), _tokenizer,
                                       "tokenizer.json"),
    "tokenizer_config.json not UTF-8": (lambda d: (_tokenizer_json(d),
                                                   (d / "tokenizer_config.json").write_bytes(b"\xff{")),
                                        _tokenizer, "tokenizer_config.json"),
    "wandb.json not JSON": (lambda d: (d / "wandb.json").write_text("{oops"), _wandb, "wandb.json"),
    "wandb.json a list": (lambda d: (d / "wandb.json").write_text("[1, 2]"), _wandb, "wandb.json"),
    "wandb.json id an object": (lambda d: (d / "wandb.json").write_text('{"id": {"a": 1}}'), _wandb, "wandb.json"),
    "run_id not UTF-8": (lambda d: (d / "run_id").write_bytes(b"\xff\xfe"), _run_id, "run_id"),
    "config.yaml a list": (lambda d: (d / "config.yaml").write_text("- 1\n- 2\n"), _saved_config, "config.yaml"),
    "config.yaml a group not a mapping": (lambda d: (d / "config.yaml").write_text("model: 3\n"), _saved_config,
                                          "config.yaml"),
    "config.yaml not UTF-8": (lambda d: (d / "config.yaml").write_bytes(b"model:\n  d_model: \xff\n"),
                              _saved_config, "config.yaml"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_file_is_one_line_naming_it(case, tmp_path):
    write, read, names = CASES[case]
    write(tmp_path)
    with pytest.raises((UsageError, RunFailure)) as e:
        read(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and names in msg, msg
