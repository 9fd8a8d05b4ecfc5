"""Fault trials (issue 23): Ctrl-C on a two-worker sweep, and SIGKILL at random moments of one
run followed by a rerun. Each writes one JSON file with every try, the machine's load and the
verdict.

    python experiments/fault_trials.py ctrl_c --tries 6 --out docs/results/ctrl_c_sweep_trials.json
    python experiments/fault_trials.py sigkill --kills 6 \
        --out docs/results/sigkill_resume_trials.json

``ctrl_c``: each try starts ``experiments/sweep.py --jobs 2`` on the MQAR smoke grid with runs
made long (100k steps, no scheduled checkpoint), waits until both workers have logged a step,
sends SIGINT to the sweep (as a terminal's Ctrl-C does: the workers run in their own session
and get it forwarded) and records the exit status, whether a traceback appeared, and how many
runs report "checkpoint saved". A try passes with status 130, no traceback and two checkpoints.

``sigkill``: one ``la-train`` run (MQAR smoke, ``--steps`` steps, a checkpoint every
``--checkpoint_every``) is trained straight in one workdir; in a second workdir the same
command is started and killed with SIGKILL after a random delay (seeded; uniform over the
straight run's wall time, so kills land in start-up, compilation, training and saving alike),
``--kills`` times, then rerun to the end. It passes when the rerun's final metrics (the last
``metrics.jsonl`` record and ``summary.json``'s eval numbers) equal the straight run's exactly.

The scripts use only the standard library and the checkout's own entry points (subprocesses),
so the machine's other load is what it is: the file records ``os.getloadavg()`` around each try.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 1800  # a hang, not slowness: the machine may be loaded many times over

LONG_GRID = """\
import importlib.util
spec = importlib.util.spec_from_file_location("mqar_sweep", {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)


def get_config(arg=None):
    config = module.get_config("smoke")
    config.base.train.num_steps = 100_000
    config.base.train.log_every = 1
    config.base.train.eval_every = 100_000
    config.base.train.checkpoint_every = 100_000
    return config
"""


def _env():
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def _load():
    return [round(x, 2) for x in os.getloadavg()]


def _wait(condition, proc, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def ctrl_c_try(scratch: Path, index: int) -> dict:
    grid = scratch / "long.py"
    grid.write_text(LONG_GRID.format(path=str(ROOT / "configs/sweeps/mqar.py")))
    workdir = scratch / f"sweep{index}"
    command = [sys.executable, str(ROOT / "experiments/sweep.py"), "--config", str(grid)]
    load_before, start = _load(), time.monotonic()
    proc = subprocess.Popen(
        [*command, "--workdir", str(workdir), "--jobs", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )

    def both_training():
        logs = list(workdir.glob("runs/*/train.log"))
        return len(logs) == 2 and all("step " in p.read_text() for p in logs)

    try:
        reached = _wait(both_training, proc, "both workers training")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = err.strip().splitlines()[-1] if err.strip() else ""
    result = dict(
        try_=index,
        both_workers_training_when_signalled=reached,
        seconds_to_signal=round(signalled - start, 1),
        seconds_signal_to_exit=round(time.monotonic() - signalled, 1),
        exit_status=proc.returncode,
        traceback="Traceback" in out + err,
        checkpoints_saved=last.count("checkpoint saved"),
        last_line=last,
        load_avg_before=load_before,
        load_avg_after=_load(),
    )
    result["passed"] = (
        reached
        and result["exit_status"] == 130
        and not result["traceback"]
        and result["checkpoints_saved"] == 2
    )
    return result


def _train_command(workdir: Path, steps: int, checkpoint_every: int) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "experiments/train.py"),
        "--config",
        str(ROOT / "configs/mqar.py:smoke"),
        "--workdir",
        str(workdir),
        f"--config.train.num_steps={steps}",
        f"--config.train.checkpoint_every={checkpoint_every}",
        "--config.train.log_every=1",
    ]


def _final(workdir: Path) -> dict:
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((workdir / "summary.json").read_text())
    last = records[-1]
    keep = ("step", "train/loss", "train/accuracy", "grad_norm", "lr")
    final = {k: last[k] for k in keep if k in last}
    final.update({k: v for k, v in summary.items() if k.startswith("eval/")})
    final["train_losses"] = {r["step"]: r["train/loss"] for r in records}
    return final


def sigkill_trials(scratch: Path, kills: int, steps: int, checkpoint_every: int, seed: int):
    straight, killed = scratch / "straight", scratch / "killed"
    load_before, start = _load(), time.monotonic()
    subprocess.run(
        _train_command(straight, steps, checkpoint_every),
        check=True,
        capture_output=True,
        env=_env(),
        timeout=DEADLINE_S,
    )
    straight_s = time.monotonic() - start
    rng = random.Random(seed)
    tries = []
    for index in range(kills):
        delay = rng.uniform(0.0, straight_s)
        proc = subprocess.Popen(
            _train_command(killed, steps, checkpoint_every),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_env(),
        )
        finished = False
        try:
            proc.wait(timeout=delay)
            finished = True  # it ended before the kill (a resumed run has less to do)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        metrics = killed / "metrics.jsonl"
        logged = (
            [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x]
            if (metrics.exists())
            else []
        )
        checkpoints = (
            sorted(int(p.name) for p in (killed / "checkpoints").glob("*") if p.name.isdigit())
            if (killed / "checkpoints").exists()
            else []
        )
        tries.append(
            dict(
                kill=index,
                delay_s=round(delay, 2),
                finished_before_kill=finished,
                last_logged_step=max(logged, default=None),
                checkpoints=checkpoints,
                load_avg=_load(),
            )
        )
    rerun = subprocess.run(
        _train_command(killed, steps, checkpoint_every),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=DEADLINE_S,
    )
    a, b = _final(straight), _final(killed) if rerun.returncode == 0 else None
    return dict(
        straight_run_s=round(straight_s, 1),
        kills=tries,
        rerun_exit_status=rerun.returncode,
        rerun_stderr_tail=rerun.stderr[-2000:],
        straight_final={k: v for k, v in a.items() if k != "train_losses"},
        rerun_final=None if b is None else {k: v for k, v in b.items() if k != "train_losses"},
        identical_final_metrics=b is not None and a == b,
        load_avg_before=load_before,
        load_avg_after=_load(),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trial", choices=("ctrl_c", "sigkill"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--tries", type=int, default=6, help="ctrl_c: sweeps to interrupt")
    parser.add_argument("--kills", type=int, default=6, help="sigkill: kills before the rerun")
    parser.add_argument("--steps", type=int, default=40, help="sigkill: steps of the run")
    parser.add_argument("--checkpoint_every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="sigkill: seed of the kill delays")
    args = parser.parse_args(argv)
    header = dict(
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        commit=subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        cpu_count=os.cpu_count(),
        started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    with tempfile.TemporaryDirectory(prefix="fault_trials_") as scratch:
        if args.trial == "ctrl_c":
            tries = []
            for i in range(args.tries):
                tries.append(ctrl_c_try(Path(scratch), i))
                print(json.dumps(tries[-1]), flush=True)
            result = dict(
                header,
                tries=tries,
                passed=sum(t["passed"] for t in tries),
                of=len(tries),
            )
        else:
            result = dict(
                header,
                steps=args.steps,
                checkpoint_every=args.checkpoint_every,
                seed=args.seed,
                **sigkill_trials(
                    Path(scratch), args.kills, args.steps, args.checkpoint_every, args.seed
                ),
            )
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("tries", "kills")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
