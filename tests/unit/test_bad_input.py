"""Bad input to ``ptdp train``, ``generate``, ``convert`` and ``plan``: one readable message, a
non-zero exit code, no worker started, nothing that existed modified.

Runs ``ptdp.cli.main`` in this process with the worker launcher replaced by a stub, so every case
takes milliseconds to a second (the tokenizer of the tiny corpus is trained once and cached).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest

from helpers.cli import tiny_flags
from ptdp import cli
from ptdp.config.flags import config_from_args
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.train_flags import local_world_size
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage, with_vocab
from ptdp.errors import DataError
from ptdp.run.checkpoint.io import save_checkpoint

TINY = tiny_flags(log_interval=None, eval_interval=None, no_progress=True)


@pytest.fixture(autouse=True)
def _restore_warning_display():
    """``ptdp train`` shows warnings as one line each; give the next test the usual display back."""
    import warnings

    shown = warnings.showwarning
    yield
    warnings.showwarning = shown


@pytest.fixture
def launched(monkeypatch) -> list:
    """Replaces the worker launcher: records each launch and stops there (exit code 1)."""
    calls = []

    def stub(config, nproc, run_dir, data_dir, **kwargs):
        calls.append(config)
        return {"error": "stopped by the test before any worker"}

    monkeypatch.setattr("ptdp.run.launch.launch_local", stub)
    return calls


def train(capsys, tmp_path: Path, *argv: str) -> tuple[int, str]:
    """``ptdp train`` with the tiny model and a cache under ``tmp_path``: (exit code, stderr)."""
    code = cli.main(["train", *TINY, "--data-cache-dir", str(tmp_path / "cache"), *argv])
    return code, capsys.readouterr().err


def snapshot(*roots: Path) -> dict[str, tuple[str, int]]:
    """(sha1, mtime_ns) of every file under ``roots``."""
    out = {}
    for root in roots:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file()) if root.is_dir() else [root]:
            out[str(path)] = (hashlib.sha1(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


# ---- data files given with --data -----------------------------------------------------------------


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    bad = tmp_path / "bad"
    bad.mkdir()
    files = {"empty": bad / "empty.txt", "binary": bad / "blob.txt", "latin-1": bad / "latin.txt", "fifo": bad / "pipe"}
    files["empty"].write_text("  \n")
    files["binary"].write_bytes(b"PK\x03\x04\x00\x00binary")
    files["latin-1"].write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    os.mkfifo(files["fifo"])
    return files


REASONS = {
    "empty": "empty (no non-blank text)",
    "binary": "contains NUL bytes (binary?)",
    "latin-1": "not valid UTF-8",
    "fifo": "not a regular file or folder",
}


def test_unusable_data_files_are_named_and_nothing_is_left_behind(tmp_path, capsys, launched):
    """Each file given is empty, binary, not UTF-8 or a FIFO (which would block a reader): each is
    named with its reason as a warning and in the error; exit 2, no run directory, no worker."""
    files = _bad_files(tmp_path)
    before = snapshot(tmp_path / "bad")
    argv = [a for f in files.values() for a in ("--data", str(f))]
    code, err = train(capsys, tmp_path, *argv, "--output-dir", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err and not launched
    error = err[err.index("ptdp train: error:") :]
    assert "no usable documents" in error and "every file was skipped" in error
    for kind, path in files.items():
        assert f"warning: skipping data file {str(path)!r}: {REASONS[kind]}" in err, kind
        assert f"{str(path)!r}: {REASONS[kind]}" in error, kind
    assert not (tmp_path / "run").exists()
    assert snapshot(tmp_path / "bad") == before
    assert not [p for p in (tmp_path / "cache").iterdir()], "a failed preparation leaves no cache folder"


def test_unusable_files_are_skipped_when_usable_ones_remain(tmp_path, capsys, flat_corpus, launched):
    files = _bad_files(tmp_path)
    code, err = train(
        capsys,
        tmp_path,
        "--data",
        str(flat_corpus),
        "--data",
        str(files["binary"]),
        "--data",
        str(files["fifo"]),
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert code == 1 and len(launched) == 1, err  # the stub launcher stops the run with exit code 1
    assert f"skipping data file {str(files['binary'])!r}" in err and f"{str(files['fifo'])!r}" in err


def test_unreadable_data_file_is_skipped_with_a_warning(tmp_path, capsys, monkeypatch):
    """chmod 000 (as root, whom permissions do not stop, the read is made to fail the same way)."""
    from ptdp.data.corpus import iter_documents

    (tmp_path / "ok.txt").write_text("fine text")
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    if os.geteuid() == 0:
        real = Path.read_bytes

        def read_bytes(self):
            if self == locked:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", read_bytes)
    try:
        with pytest.warns(UserWarning, match=r"locked.txt'?: unreadable \(Permission denied\)"):
            docs = list(iter_documents([tmp_path]))
        assert [d.text for d in docs] == ["fine text"]
        (tmp_path / "ok.txt").unlink()
        with pytest.warns(UserWarning), pytest.raises(DataError, match=r"locked.txt': unreadable"):
            list(iter_documents([tmp_path]))
    finally:
        locked.chmod(0o644)


def test_empty_files_inside_a_folder_are_skipped_silently(tmp_path):
    """An empty ``__init__.py`` in a folder is normal: no warning (a file named directly gets one)."""
    import warnings

    from ptdp.data.corpus import iter_documents

    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("x = 1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [d.doc_id for d in iter_documents([tmp_path])] == [f"{tmp_path.name}/a.py"]
    with pytest.warns(UserWarning, match="empty"):
        list(iter_documents([tmp_path / "__init__.py", tmp_path / "a.py"]))


def test_debug_shows_the_traceback_and_keeps_exit_code_2(tmp_path, capsys):
    code = cli.main(["train", *TINY, "--data", str(tmp_path / "missing"), "--data-cache-dir", str(tmp_path), "--debug"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "DataError" in err and "data path does not exist" in err


# ---- a corpus too small -------------------------------------------------------------------------


def test_corpus_too_small_names_token_counts(tmp_path, capsys, flat_corpus, launched):
    before = snapshot(flat_corpus)
    code, err = train(
        capsys,
        tmp_path,
        "--data",
        str(flat_corpus),
        "--global-batch-size",
        "100000",
        "--micro-batch-size",
        "1",
        "--dp",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert code == 2 and not launched
    assert "fewer than global_batch_size=100000: one global batch needs 100000*32+1 = 3,200,001 tokens" in err
    assert "the training split has" in err and not (tmp_path / "run").exists()
    code, err = train(
        capsys,
        tmp_path,
        "--data",
        str(flat_corpus),
        "--seq-length",
        "20000",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "1",
        "--dp",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert code == 2 and not launched
    assert "the validation split has" in err and "fewer than the seq_length+1 = 20001 tokens of one sample" in err
    assert snapshot(flat_corpus) == before


# ---- --load, --output-dir, --save -----------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path, flat_corpus) -> Path:
    """A real checkpoint (iteration 2) of the tiny model ``ptdp train`` would build from ``corpus``."""
    args = cli.build_parser().parse_args(
        ["train", *TINY, "--data", str(flat_corpus), "--data-cache-dir", str(tmp_path / "cache")]
    )
    config = resolve(config_from_args(args), local_world_size(args))
    from ptdp.run.rundir import prepare

    data = prepare(config, log=lambda _msg: None)
    one = resolve(dataclasses.replace(config, parallel=ParallelConfig(1, 1, 1)), 1)
    stage = build_stage(with_vocab(one, data.vocab_size), ParallelGroups.single_process())
    root = tmp_path / "ckpt"
    save_checkpoint(stage, root, 2, consumed_samples=16)
    return root


@pytest.mark.parametrize(
    "target,message",
    [
        ("nothing", "checkpoint path {path} does not exist"),
        ("folder", "{path} is not a ptdp checkpoint (no ptdp.json and no 'latest' file)"),
        ("file", "{path} is a file, not a ptdp checkpoint folder"),
    ],
)
def test_load_of_no_checkpoint_is_refused_before_the_data_are_prepared(
    tmp_path, capsys, flat_corpus, launched, target, message
):
    path = tmp_path / target
    if target == "folder":
        path.mkdir()
        (path / "notes.txt").write_text("not a checkpoint")
    elif target == "file":
        path.write_text("not a checkpoint")
    before = snapshot(path) if path.exists() else {}
    code, err = train(
        capsys, tmp_path, "--data", str(flat_corpus), "--load", str(path), "--output-dir", str(tmp_path / "run")
    )
    assert code == 2 and message.format(path=path) in err and "Traceback" not in err and not launched
    assert not (tmp_path / "cache").exists(), "checked before the data are prepared"
    assert cli.main(["generate", "--load", str(path), "--prompt", "def "]) == 2
    assert message.format(path=path) in capsys.readouterr().err
    assert cli.main(["convert", "to-hf", str(path), str(tmp_path / "hf")]) == 2
    assert message.format(path=path) in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()
    assert (snapshot(path) if path.exists() else {}) == before


def test_load_of_another_models_checkpoint_is_refused_before_the_data_are_prepared(
    tmp_path, capsys, flat_corpus, launched, checkpoint
):
    """A wrong shape costs no tokenization: every shape field but the vocabulary (known only once
    the data are prepared) is compared with the checkpoint's before."""
    fresh = tmp_path / "fresh-cache"
    code = cli.main(
        [
            "train",
            *TINY,
            "--hidden-size",
            "48",
            "--data",
            str(flat_corpus),
            "--data-cache-dir",
            str(fresh),
            "--load",
            str(checkpoint),
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not launched and "Traceback" not in err
    assert "is for a different model: hidden_size=32 in the checkpoint, 48 here" in err
    assert not fresh.exists(), "checked before the data are prepared"


def test_existing_run_directory_is_refused_unless_overwrite_or_continued(
    tmp_path, capsys, flat_corpus, launched, checkpoint
):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1, "loss": 5.0}\n')
    (run / "config.json").write_text(json.dumps({"checkpoint": {"save": str(checkpoint)}}))
    (run / "summary.json").write_text("{}")
    before = snapshot(run, checkpoint)
    code, err = train(capsys, tmp_path, "--data", str(flat_corpus), "--output-dir", str(run))
    assert code == 2 and not launched
    assert f"output directory {run} exists and is not empty; pass --overwrite" in err and "--load" in err
    other = tmp_path / "other-ckpt" / "iter_0000002"  # another run's checkpoint does not continue this run
    other.mkdir(parents=True)
    for name in ("ptdp.json", ".metadata"):
        (other / name).write_bytes((checkpoint / "iter_0000002" / name).read_bytes())
    code, err = train(capsys, tmp_path, "--data", str(flat_corpus), "--output-dir", str(run), "--load", str(other))
    assert code == 2 and "exists and is not empty" in err and not launched
    assert snapshot(run, checkpoint) == before
    # continuing the run from its own checkpoint keeps its metrics (the resumed lines are appended)
    code, err = train(
        capsys,
        tmp_path,
        "--data",
        str(flat_corpus),
        "--output-dir",
        str(run),
        "--load",
        str(checkpoint),
        "--save",
        str(checkpoint),
    )
    assert code == 1 and len(launched) == 1, err
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 1, "loss": 5.0}\n'
    assert snapshot(checkpoint) == {k: v for k, v in before.items() if k.startswith(str(checkpoint))}
    # --overwrite starts the run afresh in the same folder
    code, err = train(capsys, tmp_path, "--data", str(flat_corpus), "--output-dir", str(run), "--overwrite")
    assert code == 1 and len(launched) == 2 and not (run / "metrics.jsonl").exists()


def test_save_into_another_runs_checkpoints_is_refused(tmp_path, capsys, flat_corpus, launched, checkpoint):
    before = snapshot(checkpoint)
    code, err = train(
        capsys, tmp_path, "--data", str(flat_corpus), "--save", str(checkpoint), "--output-dir", str(tmp_path / "run")
    )
    assert code == 2 and not launched and not (tmp_path / "run").exists()
    assert (
        f"--save {checkpoint} already holds 1 checkpoint(s) (newest iter_0000002) that this run would "
        f"overwrite; continue from them with --load {checkpoint}"
    ) in err
    assert snapshot(checkpoint) == before
    code, err = train(
        capsys,
        tmp_path,
        "--data",
        str(flat_corpus),
        "--load",
        str(checkpoint / "iter_0000002"),
        "--save",
        str(checkpoint),
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert code == 1 and len(launched) == 1, err


# ---- checkpoints that would run code ----------------------------------------------------------------


class _Exploit:
    """Unpickling this object creates ``marker`` (as a shell command could)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_index_never_runs_code_on_any_path(tmp_path, capsys, flat_corpus, launched, checkpoint):
    """``ptdp train --load``, ``ptdp generate --load`` and ``ptdp convert to-hf`` on a checkpoint whose
    DCP index (``.metadata``, a pickle) would run a command: refused, the command never runs,
    nothing is written."""
    marker = tmp_path / "pwned"
    (checkpoint / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(_Exploit(str(marker))))
    before = snapshot(checkpoint)
    refused = "not a DCP metadata type"
    code, err = train(
        capsys, tmp_path, "--data", str(flat_corpus), "--load", str(checkpoint), "--output-dir", str(tmp_path / "run")
    )
    assert code == 2 and refused in err and "posix.system" in err and not launched
    assert cli.main(["generate", "--load", str(checkpoint), "--prompt", "def "]) == 2
    assert refused in capsys.readouterr().err
    assert cli.main(["convert", "to-hf", str(checkpoint), str(tmp_path / "hf")]) == 2
    assert refused in capsys.readouterr().err
    assert not marker.exists(), "the crafted pickle ran"
    assert snapshot(checkpoint) == before
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()


def test_convert_never_overwrites(tmp_path, capsys, checkpoint):
    target = tmp_path / "hf"
    target.mkdir()
    (target / "config.json").write_text("{}")
    before = snapshot(target)
    assert cli.main(["convert", "to-hf", str(checkpoint), str(target)]) == 2
    assert f"{target} exists and is not an empty folder; export into a new one" in capsys.readouterr().err
    assert snapshot(target) == before


# ---- rendezvous and the planner ---------------------------------------------------------------------


def test_local_runs_bind_the_rendezvous_to_loopback(monkeypatch):
    """``ptdp train``'s launcher: c10d rendezvous on 127.0.0.1 at a port the OS picks (so it never
    meets a busy port) and workers that announce 127.0.0.1; ``python -m ptdp.train`` alone: the
    same for its world of one."""
    import ptdp.run.launch
    from ptdp.run.worker import set_single_process_environment

    seen = []

    def fake_elastic_launch(config, entrypoint):
        seen.append(config)
        return lambda *args: {0: {"done": True}}

    monkeypatch.setattr(ptdp.run.launch, "elastic_launch", fake_elastic_launch)
    assert ptdp.run.launch.launch_workers(print, 2, "x") == {"done": True}
    (config,) = seen
    assert config.rdzv_endpoint == "127.0.0.1:0" and config.local_addr == "127.0.0.1"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    set_single_process_environment()
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0


def test_unknown_gpu_lists_the_known_ones(capsys):
    code = cli.main(["plan", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch-size", "8", "--gpu", "a100"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "unknown GPU 'a100'; known: a100-40gb, a100-80gb, b200, b300, gb200, gb300, h100" in err
    assert "h200" in err and "--gpu-catalog" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "0"], "ptdp plan: error: num_gpus=0 must be >= 1\n"),
        (["--gpus", "8", "--gpu", "v100-32gb", "--bf16"], "v100-32gb has no peak FLOP/s for bf16; known: fp16, fp32\n"),
        (
            ["--gpus", "8", "--fp32", "--grad-reduce-in-bf16"],
            "--grad-reduce-in-bf16 needs bf16 parameters (--bf16, or --fp8 with bf16 weights), not fp32: a bf16 "
            "gradient buffer holds the gradients of bf16 parameters\n",
        ),
    ],
)
def test_a_bad_cluster_names_only_what_is_wrong(capsys, argv, message):
    code = cli.main(["plan", "--model", "gpt-1.7b", "--global-batch-size", "8", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.endswith(message), err


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == "ptdp 0.2.0\n"


@pytest.mark.parametrize("name", ["blob.bin", "lib.so", "tokens.idx", "weights.safetensors"])
def test_a_binary_file_named_directly_is_named_with_its_reason(tmp_path, capsys, launched, name):
    """A file given with --data whose extension marks it binary is not silently dropped: the
    warning and the error name it and say why (exit 2, no worker)."""
    path = tmp_path / name
    path.write_bytes(b"\x7fELF\x02\x01" + bytes(range(256)))
    code, err = train(capsys, tmp_path, "--data", str(path), "--output-dir", str(tmp_path / "run"))
    assert code == 2 and not launched, err
    reason = f"{str(path)!r}: its extension {path.suffix!r} marks a binary file"
    assert f"warning: skipping data file {reason}" in err
    error = err[err.index("ptdp train: error:") :]
    assert "no files found" not in error and reason in error


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize(
    "flag, problem",
    [
        ("--output-dir", "output directory (--output-dir): {p} cannot be created: {f} is a file, not a directory"),
        (
            "--data-cache-dir",
            "data cache directory (--data-cache-dir or $PTDP_CACHE_DIR): {p} cannot be created: {f} is a "
            "file, not a directory",
        ),
        (
            "--save",
            "cannot use {p} as checkpoint folder (--save): {p} cannot be created: {f} is a file, not a directory",
        ),
    ],
)
def test_a_folder_under_a_file_is_refused_before_any_work(tmp_path, capsys, flat_corpus, launched, flag, problem):
    """--output-dir, --data-cache-dir and --save below a path that is a file: exit 2 naming the
    path and why, before the data are prepared (no cache written) and before any worker."""
    file = _a_file(tmp_path)
    target = file / "sub" / "dir"
    argv = ["--data", str(flat_corpus), "--output-dir", str(tmp_path / "run")]
    if flag == "--data-cache-dir":
        code = cli.main(
            [
                "train",
                *TINY,
                "--data",
                str(flat_corpus),
                "--output-dir",
                str(tmp_path / "run"),
                "--data-cache-dir",
                str(target),
            ]
        )
        err = capsys.readouterr().err
    else:
        code, err = train(capsys, tmp_path, *argv, flag, str(target))
    assert code == 2 and not launched, err
    assert problem.format(p=target, f=file) in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into folders whose mode denies it")
@pytest.mark.parametrize("flag", ["--output-dir", "--data-cache-dir"])
def test_an_unwritable_folder_is_refused_before_any_work(tmp_path, capsys, flat_corpus, launched, flag):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code = cli.main(
            [
                "train",
                *TINY,
                "--data",
                str(flat_corpus),
                "--output-dir",
                str(tmp_path / "run"),
                "--data-cache-dir",
                str(tmp_path / "cache"),
                flag,
                str(locked / "x"),
            ]
        )
    finally:
        locked.chmod(0o700)
    err = capsys.readouterr().err
    assert code == 2 and not launched and f"{locked / 'x'} cannot be created: {locked} is not writable" in err
    assert not (tmp_path / "cache").exists()


def test_folder_problem_probes_by_writing(tmp_path):
    """Whether a file can be created there is what counts, for root too (/proc takes no file)."""
    from ptdp.run.paths import folder_problem

    assert folder_problem(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()
    assert folder_problem(tmp_path) is None and not list(tmp_path.iterdir())
    assert folder_problem("/proc/ptdp-run").startswith("/proc/ptdp-run cannot be created: /proc is not writable (")


def test_a_model_that_cannot_fit_is_refused_before_any_work_unless_forced(tmp_path, capsys, flat_corpus, launched):
    """--hidden-size 65536: the planner's estimate (hundreds of GiB per rank) exceeds this machine's
    memory: exit 2 naming the estimate, the memory available and flags that help, before the data
    are prepared and before any worker or run directory; --force starts anyway."""
    argv = ["--data", str(flat_corpus), "--output-dir", str(tmp_path / "run"), "--hidden-size", "65536"]
    code, err = train(capsys, tmp_path, *argv)
    assert code == 2 and not launched, err
    assert "ptdp train: error: the run does not fit in memory: the 8 local workers together need about " in err
    assert "GiB and this machine has " in err and "--use-distributed-optimizer (" in err and "--force" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    code, err = train(capsys, tmp_path, *argv, "--force")
    assert code == 1 and len(launched) == 1, err  # the stub launcher stops the forced run


def test_memory_estimate_of_cpu_workers_and_of_gpu_ranks():
    from ptdp.planner.candidate import run_candidate
    from ptdp.planner.memory.overhead import runtime_overhead_bytes
    from ptdp.run.memory_check import CPU_WORKER_OVERHEAD, GiB, memory_problem, rank_estimates

    config = resolve(config_from_args(cli.build_parser().parse_args(["train", *TINY])), 8)
    ranks = rank_estimates(config)
    assert [r.stage for r in ranks] == [0, 1] and all(r.params > 0 and r.activations > 0 for r in ranks)
    per_stage = sum(r.total for r in ranks) * 4  # tp x dp = 4 ranks of each stage on this machine
    need = per_stage + 8 * CPU_WORKER_OVERHEAD
    assert memory_problem(config, 8, need, gpu=False, where="this machine") is None
    text = memory_problem(config, 8, need - 1, gpu=False, where="this machine")
    assert text.startswith(
        f"the run does not fit in memory: the 8 local workers together need about "
        f"{need / GiB:,.1f} GiB and this machine has "
    )
    # on GPUs the planner's overhead of the run's layout, 8 GPUs per node: context, workspaces, NCCL
    overhead = runtime_overhead_bytes(run_candidate(config, "fp32"), 8, config.model.tied)
    assert 0.5 * GiB < overhead < 1.5 * GiB
    worst = max(r.total for r in ranks) + overhead
    assert memory_problem(config, 8, worst, gpu=True, where="each GPU") is None
    assert "the most loaded rank needs about" in memory_problem(config, 8, worst - 1, gpu=True, where="each GPU")


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--tpp", "2"], "--tpp: did you mean --tp"),
        (["train", "--tp3"], "--tp3: did you mean --tp"),
        (["train", "--tensor-parallel", "2"], "--tensor-parallel: did you mean --tensor-model-parallel-size"),
        (["train", "--num-layer", "2"], "--num-layer: did you mean --num-layers"),
        (["train", "--hiden-size=64"], "--hiden-size: did you mean --hidden-size"),
        (["plan", "--gpuz", "8"], "--gpuz: did you mean --gpu"),
    ],
)
def test_an_unknown_flag_is_a_few_lines_naming_the_closest_flags(capsys, argv, hint):
    """No usage: the error, the closest flags (an abbreviation is not taken for a flag it begins)
    and where --help is."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage:" not in err and len(err.splitlines()) <= 4, err
    assert err.startswith(f"ptdp {argv[0]}: error: unrecognized arguments: {' '.join(argv[1:])}\n"), err
    assert hint in err and err.rstrip().endswith(f"(see `ptdp {argv[0]} --help`)"), err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--cp-comm-type", "foo"], "argument --cp-comm-type: invalid choice: 'foo'"),
        (["train", "--recompute-granularity", "bad"], "argument --recompute-granularity: invalid choice: 'bad'"),
        (["train", "--tp", "x"], "invalid int value: 'x'"),
        (["trian"], "argument COMMAND: invalid choice: 'trian'"),
    ],
)
def test_a_bad_value_is_one_line_and_where_help_is(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 2 and message in lines[0], lines
    assert lines[1].strip().startswith("(see `ptdp") and lines[1].strip().endswith("--help`)"), lines


def test_the_worker_entry_point_names_the_closest_flags_too(capsys, monkeypatch):
    from ptdp.run import worker

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # as under a launcher: no environment set for a world of one

    with pytest.raises(SystemExit) as exit_:
        worker.main(["--num-layer", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage:" not in err, err
    assert "--num-layer: did you mean --num-layers" in err and "(see `python -m ptdp.train --help`)" in err, err


def test_nonpositive_nproc_per_node_is_named(tmp_path, capsys, launched):
    code, err = train(capsys, tmp_path, "--nproc-per-node", "-2")
    assert code == 2 and not launched
    assert "nproc_per_node=-2 must be a positive integer" in err and "world_size" not in err


@pytest.mark.parametrize("flag", ["--tp", "--cp", "--pp"])
def test_a_nonpositive_size_is_named_once_not_the_world_size_it_makes(tmp_path, capsys, launched, flag):
    """``--cp 0`` makes the default world size tp x cp x pp x dp = 0: only the size given is named."""
    code, err = train(capsys, tmp_path, flag, "0")
    assert code == 2 and not launched
    assert "size=0 must be a positive integer" in err and "world_size" not in err, err


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--bf16", "--fp16"], "--bf16 and --fp16"),
        (["--params-dtype", "float64", "--bf16"], "--params-dtype and --bf16"),
        (["--fp32", "--params-dtype", "bfloat16"], "--fp32 and --params-dtype"),
    ],
)
def test_conflicting_precision_flags_are_refused_naming_both(capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", *flags, "--print-config"])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_the_same_precision_twice_is_fine(capsys):
    assert cli.main(["train", "--bf16", "--params-dtype", "bfloat16", "--print-config"]) == 0
    assert '"params_dtype": "bfloat16"' in capsys.readouterr().out


def test_async_save_without_save_is_refused(capsys):
    assert cli.main(["train", "--async-save", "--print-config"]) == 2
    assert "--async-save needs a save directory (--save)" in capsys.readouterr().err


def test_more_cpu_workers_than_cores_is_said_before_the_start(tmp_path, capsys, launched, monkeypatch):
    """tp 2 x pp 2 x dp 4 on 2 cores: the warning names both numbers before any worker starts; as many
    workers as cores say nothing."""
    import ptdp.commands.train as train_command

    monkeypatch.setattr(train_command, "cpu_cores", lambda: 2)
    monkeypatch.setattr(train_command, "visible_gpus", lambda: None)
    code, err = train(
        capsys, tmp_path, "--nproc-per-node", "16", "--tp", "2", "--pp", "2", "--output-dir", str(tmp_path / "a")
    )
    assert code == 1 and len(launched) == 1, err
    assert "warning: 16 workers on 2 CPU cores, 8 per core" in err, err
    code, err = train(
        capsys, tmp_path, "--nproc-per-node", "2", "--tp", "1", "--pp", "1", "--output-dir", str(tmp_path / "b")
    )
    assert code == 1 and len(launched) == 2 and "CPU cores" not in err, err
