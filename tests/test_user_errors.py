"""A mistake in the user's input ends a torchrun launch with one ``error:`` line from rank 0, exit 2.

Unit tests (one process): the raise sites give :class:`UserInputError`, it is found through Hydra's
``InstantiationException``, :func:`run_phase` prints one line and leaves programming errors alone,
and checkpoint model signatures tell models apart.

Launch tests (``torchrun --nproc-per-node 2 --tee 3``, the same command line a user types plus
``--tee`` so every console line says which rank printed it): one launch per case, all run by one
module-scoped fixture. Each case asserts exactly one ``error:`` line, printed by rank 0 (torchrun
prefixes it ``[default0]:``); no traceback from a rank on the terminal (the only one left is
torchrun's own ``ChildFailedError`` report, see README "Errors"); every rank's exit code 2 in that
report; the traceback in ``<run dir>/logs/rank_<r>.log``. One launch per phase a rank can fail in (data on every
rank, data on rank 1 only, the model's config, the model check, the checkpoint resume, the config before any
process group); the raise sites of the same phase (an empty split, a missing tokenizer) are unit tests above.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from automodel.errors import UserInputError
from automodel.training.checkpoint_compat import (
    SIGNATURE_FILE,
    check_model_signature,
    model_signature,
    signature_differences,
    write_model_signature,
)
from automodel.training.user_errors import EXIT_USER_ERROR, RunAborted, find_user_error, run_phase
from tests.dist_harness import free_port

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune.py"
CONFIG = REPO / "configs" / "cp.yaml"
TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=1",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "data.seq_len=64",
    "step_scheduler.global_batch_size=2",
    "step_scheduler.local_batch_size=1",
    "step_scheduler.max_steps=1",
    "step_scheduler.val_every_steps=null",
    "lr_scheduler.warmup_steps=0",
    "export.enabled=false",
    "logging.progress_bar=false",
    "logging.plot=false",
]


# ------------------------------------------------------------------ unit tests (one process)


def test_raise_sites_are_user_input_errors(tmp_path):
    from automodel.config.schema import ModelSection
    from automodel.data.file_readers import read_jsonl, resolve_files
    from automodel.data.tokenizer import load_tokenizer
    from automodel.models.loader import resolve_model_config

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(UserInputError, match=r"bad.jsonl:2 is not valid JSON"):
        list(read_jsonl(bad))
    with pytest.raises(UserInputError, match=r"does not exist"):
        resolve_files(tmp_path / "nope.jsonl")
    with pytest.raises(UserInputError, match=r"tokenizer path .* is not a directory"):
        load_tokenizer(str(tmp_path / "no_tokenizer"))
    (tmp_path / "model").mkdir()
    with pytest.raises(UserInputError, match=r"no config found"):
        resolve_model_config(ModelSection(pretrained_model_name_or_path=str(tmp_path / "model")), dry_run=True)
    from automodel.data.text_dataset import TextDataset

    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "just one short document"}\n')
    with pytest.raises(UserInputError, match=r"split 'train' of .*tiny\.jsonl.* has no documents .*add data, raise "
                                             r"val_fraction"):  # fmt: skip
        TextDataset(tiny, load_tokenizer(None), seq_len=64, val_fraction=0.9999)


def test_seq_len_past_the_positions_is_refused_unless_scaled_or_allowed():
    """A RoPE model past max_position_embeddings trains on positions it never saw: refused with the YaRN keys that
    cover the row, unless the config sets a RoPE scaling or model.allow_position_extrapolation=true; a position
    table (GPT-2) is refused even then. The dry run (the run's own check, before weights) refuses it too."""
    from transformers import GPT2Config, LlamaConfig

    from automodel.config import ConfigError, load_config
    from automodel.models.loader import check_model_for_run, model_positions
    from automodel.training.dry_run import dry_run_report

    llama = LlamaConfig(max_position_embeddings=2048, rope_theta=10000.0)
    run = dict(attn_implementation="sdpa", cp_size=1, cp_method="ring")
    check_model_for_run(llama, seq_len=2048, **run)
    with pytest.raises(UserInputError) as e:
        check_model_for_run(llama, seq_len=5000, **run)
    assert str(e.value) == (
        "data.seq_len=5000 is past LlamaConfig.max_position_embeddings=2048: the model was never trained on the "
        "positions past it and would train with extrapolated ones; set a RoPE scaling that covers them, e.g. YaRN: "
        "++model.config_overrides.max_position_embeddings=6144 ++model.config_overrides.rope_parameters={rope_type:"
        "yarn,factor:3.0,original_max_position_embeddings:2048,rope_theta:10000.0}; or set "
        "model.allow_position_extrapolation=true to train past them as they are (docs/long_context.md)"
    )
    check_model_for_run(llama, seq_len=5000, allow_position_extrapolation=True, **run)
    scaled = LlamaConfig(max_position_embeddings=6144, rope_parameters={
        "rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0})  # fmt: skip
    assert model_positions(scaled).scaling == "yarn"
    check_model_for_run(scaled, seq_len=6144, **run)
    check_model_for_run(scaled, seq_len=9000, **run)  # past the scaled positions: the user's scaling, trained as set
    with pytest.raises(UserInputError, match=r"past GPT2Config\.max_position_embeddings=1024, the rows of its "
                                             r"position table; lower data\.seq_len to at most 1024"):  # fmt: skip
        check_model_for_run(GPT2Config(), seq_len=2048, allow_position_extrapolation=True, **run)
    # an inline model.config: the config rules refuse it (before any rank starts); a pretrained one: the model checks
    base = ["--config", str(CONFIG), "recipe.dry_run=true", "data.seq_len=4096"]
    with pytest.raises(ConfigError, match=r"data\.seq_len=4096 is past LlamaConfig\.max_position_embeddings=2048"):
        load_config(base, world_size=2)
    assert "dry run: nothing was trained" in dry_run_report(
        load_config([*base, "model.allow_position_extrapolation=true"], world_size=2))
    yarn = ["++model.config_overrides.max_position_embeddings=4096", "++model.config_overrides.rope_parameters={rope_type:"
            "yarn,factor:2.0,original_max_position_embeddings:2048,rope_theta:10000.0}"]  # fmt: skip
    assert "dry run: nothing was trained" in dry_run_report(load_config([*base, *yarn], world_size=2))
    loaded = load_config(["--config", "configs/qwen3_1_7b_64k_cp8.yaml", "recipe.dry_run=true", "model.config_overrides=null",
                          "data.seq_len=65536"], world_size=16)  # pretrained: its config is read by the model checks
    with pytest.raises(UserInputError, match=r"data\.seq_len=65536 is past Qwen3Config\.max_position_embeddings=32768"):
        dry_run_report(loaded)


#: families without RoPE parameters whose positions are a table (refused past it) or nothing (no limit)
POSITION_TABLES = ("gpt2", "gpt_bigcode", "opt", "biogpt", "ctrl", "openai-gpt", "gpt_neo", "gptj", "codegen", "xglm")
NO_POSITIONS = ("jamba", "nemotron_h", "rwkv", "kimi_linear", "inkling_text")


@pytest.mark.parametrize("name", POSITION_TABLES + NO_POSITIONS)
def test_a_limit_without_rope_stands_only_for_a_position_table(name):
    """Without RoPE parameters, max_position_embeddings limits the row only where the model looks its positions up in
    a table (the config rules, the model checks and ``automodel plan`` read :func:`model_positions`). Where it has
    none, the limit changes nothing the model computes: the same weights at a limit of 16 and of 4096 give the same
    logits for 48 tokens (Jamba, Nemotron-H, RWKV and Kimi Linear were refused past it as "the rows of its
    position table")."""
    from transformers import AutoModelForCausalLM

    from automodel.models.loader import check_model_for_run, model_positions
    from tests.family_matrix import absent_reason, family_by_name

    if absent_reason(name):
        pytest.skip(absent_reason(name))
    config = family_by_name(name).build_config()
    limit = model_positions(config).limit
    run = dict(attn_implementation="eager", cp_size=1, cp_method="ring")
    if name in POSITION_TABLES:
        assert limit == config.max_position_embeddings
        with pytest.raises(UserInputError, match="the rows of its position table"):
            check_model_for_run(config, seq_len=limit + 1, allow_position_extrapolation=True, **run)
        return
    assert limit is None
    ids = torch.randint(3, 100, (1, 48), generator=torch.Generator().manual_seed(0))
    logits = []
    for positions in (16, 4096):
        config.max_position_embeddings = positions
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids, use_cache=False).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_user_error_is_found_through_hydra_instantiate(tmp_path):
    from hydra.utils import instantiate

    node = {"_target_": "automodel.data.file_readers.resolve_files", "path": str(tmp_path / "missing")}
    with pytest.raises(Exception) as info:
        instantiate(node)
    assert not isinstance(info.value, UserInputError)  # Hydra wraps it ...
    found = find_user_error(info.value)  # ... and the recipe still finds it
    assert isinstance(found, UserInputError) and "does not exist" in str(found)
    assert find_user_error(ValueError("a bug")) is None
    try:
        try:
            raise UserInputError("bad line")
        except UserInputError:
            raise KeyError("a bug in the handler")  # noqa: B904 (implicit context on purpose)
    except KeyError as bug:
        assert find_user_error(bug) is None  # a bug while handling a user error stays a bug


def test_run_phase_one_line_for_user_errors_and_tracebacks_for_bugs(capsys):
    def bad_input():
        raise UserInputError("data.dataset.path 'x' does not exist; set data.dataset.path")

    with pytest.raises(RunAborted) as info:
        run_phase(bad_input)
    assert info.value.exit_code == EXIT_USER_ERROR == 2
    assert capsys.readouterr().err == "error: data.dataset.path 'x' does not exist; set data.dataset.path\n"

    def bug():
        raise ValueError("index out of range in the collator")

    with pytest.raises(ValueError, match="collator"):  # a programming error is not swallowed
        run_phase(bug)
    assert capsys.readouterr().err == ""
    assert run_phase(lambda: 7) == 7


def _tiny_llama(hidden: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg)


def test_model_signature_tells_models_apart(tmp_path):
    a, b = _tiny_llama(32), _tiny_llama(64)
    sig = model_signature(a)
    assert sig["config_class"] == "LlamaConfig"
    assert sig["params"]["model.embed_tokens.weight"] == [128, 32]
    assert signature_differences(sig, model_signature(_tiny_llama(32))) == []
    diff = signature_differences(sig, model_signature(b))
    assert len(diff) == 1 and diff[0].startswith("parameter shapes differ: model.embed_tokens.weight: [128, 32]")
    assert "more)" in diff[0]  # only the first few are listed

    write_model_signature(tmp_path, a)
    check_model_signature(tmp_path, _tiny_llama(32))  # the same model: fine
    with pytest.raises(UserInputError, match=r"was written by a different model .* \[128, 32\] in the checkpoint, "
                                             r"\[128, 64\] now"):  # fmt: skip
        check_model_signature(tmp_path, b)
    check_model_signature(tmp_path / "old_checkpoint_without_signature", b)  # nothing to compare: loads as before


def test_signature_lists_missing_and_extra_parameters():
    sig = {"config_class": "LlamaConfig", "params": {"a": [2], "b": [3]}}
    now = {"config_class": "Qwen2Config", "params": {"a": [2], "c": [3]}}
    diff = signature_differences(sig, now)
    assert diff == [
        "model config class LlamaConfig in the checkpoint, Qwen2Config now",
        "parameters missing from the checkpoint: c",
        "parameters in the checkpoint that the model lacks: b",
    ]


# ------------------------------------------------------------------ torchrun launches


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def _torchrun(tmp: Path, name: str, *overrides: str) -> dict:
    run_dir = tmp / name / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--log-dir", str(tmp / name / "torchrun_logs"), str(RECIPE), "--config", str(CONFIG), *TINY,
           f"recipe.output_dir={run_dir}", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300)
    return {"rc": proc.returncode, "out": proc.stdout + proc.stderr, "run_dir": run_dir}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user_errors")
    data = tmp / "data"
    data.mkdir()
    (data / "malformed.jsonl").write_text('{"text": "one good line of text"}\n{"text": "cut off\n')
    (data / "only_rank_0.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                                                     for i in range(40)))  # fmt: skip
    (tmp / "model_without_config").mkdir()

    # a checkpoint of a 64-wide model (world 1, plain python: also proves the recipe's own exit code)
    ckpt_run = tmp / "ckpt" / "run"
    ok = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(CONFIG), *TINY, "distributed.cp_size=1",
         f"recipe.output_dir={ckpt_run}"],
        cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad_dir = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(CONFIG), *TINY, "distributed.cp_size=1",
         f"recipe.output_dir={tmp / 'plain' / 'run'}", f"model.pretrained_model_name_or_path={tmp / 'nowhere'}",
         "~model.config"],
        cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip

    # a missing validation file (one process): the error names the key it came from, not data.dataset.path
    bad_val = subprocess.run(
        [sys.executable, str(RECIPE), "--config", str(CONFIG), *TINY, "distributed.cp_size=1",
         f"recipe.output_dir={tmp / 'val' / 'run'}", "step_scheduler.val_every_steps=1",
         "+data.validation_dataset._target_=automodel.data.text_dataset.TextDataset",
         f"+data.validation_dataset.path={tmp / 'no_such_validation.jsonl'}"],
        cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip

    return {
        "plain_python": {"rc": bad_dir.returncode, "out": bad_dir.stdout + bad_dir.stderr,
                         "run_dir": tmp / "plain" / "run"},  # fmt: skip
        "missing_validation": {"rc": bad_val.returncode, "out": bad_val.stdout + bad_val.stderr},
        "malformed_jsonl": _torchrun(tmp, "malformed", f"data.dataset.path={data / 'malformed.jsonl'}"),
        # rank 1 looks for only_rank_1.jsonl, which does not exist: rank 0 prints rank 1's message
        "missing_on_rank_1": _torchrun(
            tmp, "missing", f"data.dataset.path={data}/only_rank_${{oc.env:LOCAL_RANK}}.jsonl"
        ),
        "model_without_config": _torchrun(
            tmp, "model", f"model.pretrained_model_name_or_path={tmp / 'model_without_config'}", "~model.config"
        ),
        "incompatible_checkpoint": _torchrun(
            tmp, "resume", "model.config.hidden_size=32", f"checkpoint.resume_from={ckpt_run}/checkpoints/step_1"
        ),
        # gpt-oss has no SDPA path: the model check names the fix that works, model.attn_implementation=eager
        "gpt_oss_sdpa": _torchrun(
            tmp, "gpt_oss", "model.config._target_=transformers.GptOssConfig", "+model.config.head_dim=16",
            "+model.config.num_local_experts=2", "+model.config.num_experts_per_tok=1", "distributed.cp_method=ulysses",
        ),
        # a config mistake under plain torchrun: every rank finds it before any process group exists
        "config_typo": _torchrun(tmp, "config", "step_scheduler.max_step=10"),
    }


CASES = {
    "malformed_jsonl": (r"malformed\.jsonl:2 is not valid JSON .*every line of a \.jsonl file must be one JSON", 0),
    "missing_on_rank_1": (r"data path '.*only_rank_1\.jsonl' does not exist; set data\.dataset\.path to an existing", 1),
    "gpt_oss_sdpa": (
        r"error: GptOssForCausalLM cannot run attn_implementation='sdpa'; set model\.attn_implementation=eager "
        r"\(distributed\.cp_method=ulysses runs eager models\)$",
        0,
    ),
    "model_without_config": (r"model\.pretrained_model_name_or_path='.*model_without_config': no config found", 0),
    "incompatible_checkpoint": (
        r"checkpoint .*step_1 was written by a different model than this run builds: parameter shapes differ: "
        r"model\.embed_tokens\.weight: \[1024, 64\] in the checkpoint, \[1024, 32\] now",
        0,
    ),
}


def _without_launcher_report(out: str) -> str:
    """The console minus torchrun's own ChildFailedError traceback (from its first frame to the report's end)."""
    start = out.find("Traceback (most recent call last):")
    if start < 0:
        return out
    end = out.find("ChildFailedError", start)
    assert end > 0, out  # the one traceback left on the console is torchrun's
    return out[:start] + out[out.find("=" * 60 + "\n", out.rfind("Root Cause")) + 61 :]


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(CASES))
def test_user_error_is_one_line_from_rank_0(launches, case):
    pattern, failing_rank = CASES[case]
    run = launches[case]
    out = run["out"]
    assert run["rc"] != 0, out
    errors = [line for line in out.splitlines() if "error:" in line and "ChildFailedError" not in line]
    assert len(errors) == 1, out
    assert errors[0].startswith("[default0]:error: "), out  # printed by rank 0, once
    assert re.search(pattern, errors[0]), errors[0]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and set(codes) == {"2"}, out  # every rank exited 2 (torchrun's report lists them)
    rest = _without_launcher_report(out)
    assert "Traceback" not in rest and "UserInputError" not in rest, out  # no rank traceback
    log = (run["run_dir"] / "logs" / f"rank_{failing_rank}.log").read_text()
    assert "Traceback (most recent call last)" in log and "automodel.errors.UserInputError" in log, log


@pytest.mark.dist
def test_config_error_under_torchrun_is_agreed_before_any_rank_exits(launches):
    """The ranks form a gloo group only to agree (user_errors.report_error_before_setup): rank 0 prints
    the line once, and every rank exits 2 after that (none is killed by the launcher first)."""
    out = launches["config_typo"]["out"]
    errors = [line for line in out.splitlines() if "error:" in line and "ChildFailedError" not in line]
    assert errors == [
        "[default0]:error: step_scheduler.max_step: unknown key; did you mean 'step_scheduler.max_steps'? check "
        "the spelling (every key: docs/recipe.md)"
    ], out
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and set(codes) == {"2"}, out


@pytest.mark.dist
def test_plain_python_exits_2_with_one_line(launches):
    run = launches["plain_python"]
    assert run["rc"] == 2, run["out"]
    assert run["out"].count("error: ") == 1 and "Traceback" not in run["out"], run["out"]
    assert "nowhere" in run["out"] and "no config found" in run["out"]


@pytest.mark.dist
def test_missing_validation_file_names_its_own_key(launches):
    run = launches["missing_validation"]
    errors = [line for line in run["out"].splitlines() if line.startswith("error: ")]
    assert run["rc"] == 2 and len(errors) == 1, run["out"]
    assert re.search(r"data path '.*no_such_validation\.jsonl' does not exist; set data\.validation_dataset\.path to "
                     r"an existing", errors[0]), errors[0]  # fmt: skip


def test_data_path_errors_name_the_key_in_use(tmp_path):
    """Outside the recipe the reader cannot know which dataset node it serves: it names both keys."""
    from automodel.data.file_readers import data_path_key, resolve_files

    with pytest.raises(UserInputError, match=r"set data\.dataset\.path \(or data\.validation_dataset\.path\) to"):
        resolve_files(tmp_path / "nope.jsonl")
    with data_path_key("data.validation_dataset.path"), pytest.raises(UserInputError) as err:
        resolve_files(tmp_path / "nope.jsonl")
    assert "set data.validation_dataset.path to an existing" in str(err.value) and "data.path" not in str(err.value)
    with pytest.raises(UserInputError, match=r"set data\.dataset\.path \(or"):  # the context is left behind
        resolve_files([])


@pytest.mark.dist
def test_checkpoint_holds_the_model_signature(launches):
    sig_files = list((launches["incompatible_checkpoint"]["run_dir"].parents[1] / "ckpt").rglob(SIGNATURE_FILE))
    assert len(sig_files) == 1
    sig = json.loads(sig_files[0].read_text())
    assert sig["config_class"] == "LlamaConfig" and sig["params"]["model.embed_tokens.weight"] == [1024, 64]
