"""``ptdp schedule``: text, JSON that an independent NCCL simulation accepts, the plot, bad input."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main as ptdp_main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = ptdp_main(["schedule", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def replay_under_nccl(doc: dict) -> None:
    """An NCCL model written from the JSON alone: each rank runs its groups in order, one at a time;
    the n-th send from a to b on a communicator meets the n-th receive on b from a, which must carry
    the same tag; a send and its receive move their data only while both of their groups are running
    (rendezvous, no buffering); a group ends when all of its operations have moved."""
    ranks = {r["rank"]: r["p2p_groups"] for r in doc["ranks"]}
    queues = {}
    for r, groups in ranks.items():
        for gi, g in enumerate(groups):
            for oi, o in enumerate(g["ops"]):
                a, b = (r, o["peer"]) if o["op"] == "send" else (o["peer"], r)
                queues.setdefault((g["communicator"], a, b, o["op"]), []).append(((r, gi, oi), o["tag"]))
    partner = {}
    for (comm, a, b, op), sends in queues.items():
        if op == "send":
            recvs = queues[(comm, a, b, "recv")]
            assert [t for _, t in sends] == [t for _, t in recvs], (comm, a, b)
            for (s_id, _), (r_id, _) in zip(sends, recvs):
                partner[s_id], partner[r_id] = r_id, s_id
    assert sum(len(g["ops"]) for gs in ranks.values() for g in gs) == len(partner)
    pc, moved = {r: 0 for r in ranks}, set()
    while any(pc[r] < len(ranks[r]) for r in ranks):
        running = {(r, pc[r]) for r in ranks if pc[r] < len(ranks[r])}
        for r, g in running:
            for oi in range(len(ranks[r][g]["ops"])):
                if partner[(r, g, oi)][:2] in running:
                    moved.add((r, g, oi))
        done = [(r, g) for r, g in running if all((r, g, oi) in moved for oi in range(len(ranks[r][g]["ops"])))]
        assert done, f"deadlock at {sorted(running)}"
        for r, _ in done:
            pc[r] += 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--pipeline-schedule", "1f1b", "--pp", "4", "--num-microbatches", "8"],
        ["--pipeline-schedule", "gpipe", "--pp", "2", "--num-microbatches", "3"],
        [
            "--pipeline-schedule",
            "interleaved-1f1b",
            "--pp",
            "4",
            "--num-microbatches",
            "16",
            "--virtual-pipeline-stages",
            "3",
        ],
        [
            "--pipeline-schedule",
            "interleaved-1f1b",
            "--pp",
            "8",
            "--num-microbatches",
            "32",
            "--virtual-pipeline-stages",
            "4",
        ],
        ["--pipeline-schedule", "zb-h1", "--pp", "4", "--num-microbatches", "8"],
        ["--pipeline-schedule", "zb-h2", "--pp", "4", "--num-microbatches", "9"],
        ["--pipeline-schedule", "zb-v", "--pp", "4", "--num-microbatches", "8"],
        ["--pipeline-schedule", "zb-v", "--pp", "3", "--num-microbatches", "2"],
        ["--pipeline-schedule", "dualpipev", "--pp", "4", "--num-microbatches", "10"],
        ["--pipeline-schedule", "auto", "--pp", "4", "-m", "12", "--memory-limit", "7", "--time-forward", "2"]
        + ["--time-backward-input", "2", "--time-backward-weight", "1", "--time-p2p", "0.5"],
    ],
)
def test_json_replays_deadlock_free_under_an_independent_nccl_model(capsys, argv):
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    doc = json.loads(out)
    assert {"rank", "program", "p2p_groups"} <= set(doc["ranks"][0])
    assert all(o["op"] in ("send", "recv") for r in doc["ranks"] for g in r["p2p_groups"] for o in g["ops"])
    replay_under_nccl(doc)
    p, m = doc["pp"], doc["num_microbatches"]
    v = doc["virtual_pipeline_stages"]
    computes = [s for s in doc["ranks"][0]["program"] if not s.startswith(("p2p", "handover"))]
    if doc["pipeline_schedule"] in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert doc["bubble"]["ideal"] == pytest.approx((p - 1) / (v * m))
        assert doc["bubble"]["per_rank"] == pytest.approx([(p - 1) / (v * m)] * p)
        # the longest span is the ideal time plus (p - 1) (F + B + W) / v
        assert doc["bubble"]["simulated"] == pytest.approx((p - 1) / (v * m + p - 1))
        assert len(computes) == 2 * m * v
    else:  # a whole backward, or a B and its W
        whole = sum(s.startswith("backward mb") for s in computes)
        assert len(computes) == 2 * m * v + (m * v - whole)
    assert doc["placement"] == ("v" if doc["pipeline_schedule"] in ("zb-v", "dualpipev") else "looped")


@pytest.mark.parametrize("kind,rate", [("1f1b", 0.2431), ("zb-h1", 0.1585)])
def test_measured_times_give_table_5(capsys, kind, rate):
    """Qi et al. (arXiv:2401.10241), Table 5 from Table 9's times: 1.5B model, p = 8, m = 24."""
    times = ["--time-forward", "18.522", "--time-backward-input", "18.086", "--time-backward-weight", "9.337"]
    code, out, _ = run(capsys, "--pipeline-schedule", kind, "--pp", "8", "-m", "24", *times, "--time-p2p", "0.601")
    assert code == 0 and f"simulated: (span - m (F + B + W)) / span = {rate:.4f} with F 18.522" in out
    code, out, _ = run(
        capsys, "--pipeline-schedule", kind, "--pp", "8", "-m", "24", *times, "--time-p2p", "0.601", "--json"
    )
    doc = json.loads(out)
    assert round(doc["bubble"]["simulated"], 4) == rate
    assert doc["bubble"]["times"] == {
        "forward": 18.522,
        "backward_input": 18.086,
        "backward_weight": 9.337,
        "p2p": 0.601,
    }


def test_the_v_turn_is_a_handover_in_the_program(capsys):
    code, out, _ = run(capsys, "--pipeline-schedule", "zb-v", "--pp", "2", "-m", "3")
    assert code == 0 and "placement v" in out and "bubble: 0 from m = 2p - 1 = 0.0000" in out
    last = out[out.index("rank 1:") :]
    assert "handover_forward mb0 chunk1" in last and "handover_backward mb0 chunk0" in last
    assert "backward_input mb0 chunk1" in last and "backward_weight mb0 chunk1" in last


def test_text_names_every_rank_and_the_bubble(capsys):
    code, out, _ = run(capsys, "--pp", "2", "-m", "4")
    assert code == 0
    assert "bubble: (p - 1) / (v m) = 0.2500" in out
    assert "rank 0:" in out and "rank 1:" in out
    assert "p2p [send act:mb0:vs0 -> 1]" in out and "p2p [recv act:mb0:vs0 <- 0]" in out


@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-h1", "dualpipev"])
def test_plot_writes_a_png(capsys, tmp_path, kind):
    path = tmp_path / "s.png"
    code, out, _ = run(capsys, "--pipeline-schedule", kind, "--pp", "2", "-m", "4", "--plot", str(path))
    assert code == 0 and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--pipeline-schedule", "interleaved-1f1b", "--pp", "4", "-m", "6"],
            "num_microbatches % pp == 0: pp=4, num_microbatches=6",
        ),
        (
            ["--pipeline-schedule", "1f1b", "--pp", "2", "-m", "4", "--virtual-pipeline-stages", "2"],
            "needs interleaved-1f1b",
        ),
        (["--pp", "0", "-m", "4"], "must be >= 1"),
        (["--pipeline-schedule", "dualpipev", "--pp", "4", "-m", "6"], "dualpipev needs num_microbatches >= 2 * pp"),
        (["--pipeline-schedule", "zb-v", "--pp", "2", "--virtual-pipeline-stages", "3"], "virtual_stages=3 must be 2"),
        (["--memory-limit", "3"], "--memory-limit 3 is the auto schedule's; --pipeline-schedule is 1f1b"),
        (["--pipeline-schedule", "auto", "--memory-limit", "0"], "memory limit is 0 microbatches; it must be >= 1"),
        (["--time-forward", "2"], "--time-forward given without --time-backward-input, --time-backward-weight"),
        (["--time-p2p", "-1"], "--time-p2p -1.0: a time must be a finite number >= 0"),
        (
            ["--time-forward", "0", "--time-backward-input", "1", "--time-backward-weight", "1"],
            "--time-forward 0.0: a time must be a finite number > 0",
        ),
        (["--pp", "100000", "-m", "8"], "= 100000 x 1 x 8 = 800,000: ptdp schedule proves"),
    ],
)
def test_bad_shapes_exit_2_naming_the_rule(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_debug_keeps_exit_code_2_and_a_closed_pipe_is_no_failure(capsys, monkeypatch):
    code, _, err = run(capsys, "--pp", "0", "-m", "4", "--debug")
    assert code == 2 and "Traceback" in err and "must be >= 1" in err
    import ptdp.commands.schedule as command

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(command, "run", closed)
    import os
    import sys

    saved = os.dup(sys.stdout.fileno()) if hasattr(sys.stdout, "fileno") and _has_fd(sys.stdout) else None
    try:
        assert ptdp_main(["schedule", "--pp", "2"]) == 0
    finally:
        if saved is not None:
            os.dup2(saved, sys.stdout.fileno())
            os.close(saved)


def _has_fd(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (OSError, ValueError, AttributeError):
        return False


@pytest.mark.parametrize(
    "plot,message", [("x.txt", "ending in .png"), ("/nonexistent/x.png", "does not exist"), ("", "ending in .png")]
)
def test_bad_plot_paths_exit_2_before_any_output(capsys, plot, message):
    code, out, err = run(capsys, "--pp", "2", "-m", "4", "--plot", plot)
    assert code == 2 and message in err and out == ""


def test_plot_into_a_folder_is_refused(capsys, tmp_path):
    folder = tmp_path / "pictures.png"
    folder.mkdir()
    code, out, err = run(capsys, "--pp", "2", "-m", "4", "--plot", str(folder))
    assert code == 2 and "is a folder" in err and out == ""


def test_zero_virtual_stages_is_refused_not_replaced(capsys):
    code, _, err = run(
        capsys, "--pipeline-schedule", "interleaved-1f1b", "--pp", "2", "-m", "4", "--virtual-pipeline-stages", "0"
    )
    assert code == 2 and "must be >= 1" in err
