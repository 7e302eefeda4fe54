"""train(spark, pipeline, num_processes): data-parallel training on Spark barrier tasks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Sequence

from ._local import check_torch, pipeline_binary

STDERR_LINES = 40


def train(spark, pipeline: str, num_processes: int = 2, *, args: Sequence[str] = (),
          cwd: str | None = None, binary: str | None = None) -> list[dict]:
    """Runs `pipeline run --json -q PIPELINE *args` as `num_processes` ranks of one
    data-parallel job, one rank per Spark barrier task, and returns rank 0's stage reports.

    It is what pyspark.ml.torch.distributor.TorchDistributor(num_processes,
    local_mode=False).run(...) does for a torch script: the tasks of one barrier stage start
    together; each runs the binary with torchrun's environment (RANK = its partition,
    WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE among the tasks on its host, MASTER_ADDR =
    partition 0's host, MASTER_PORT = a free port rank 0 picked and shared with allGather,
    CUDA_VISIBLE_DEVICES = the task's "gpu" resource if it has one). Rank 0 hosts the
    rendezvous, runs every stage and alone writes output, so `pipeline` (made absolute
    here), `cwd` (default: this process's working directory) and the paths the file names
    must be the same on every node: a shared file system, or object-store tables. The binary
    is `binary`, else the executors' (LAKEML_PIPELINE, the lakeml wheel's, the PATH's).

    Spark retries a barrier stage whole: when a task or an executor is lost, every rank starts
    again, and the rerun resumes from the last checkpoint (`checkpoint_every`). A rank that
    exits with an error is not retried: RuntimeError names each failed rank with the tail of
    its stderr.
    """
    from pyspark import BarrierTaskContext

    command = ["run", "--json", "-q", os.path.abspath(pipeline), *args]
    cwd = cwd or os.getcwd()

    def run_rank(_):
        ctx = BarrierTaskContext.get()
        me = ctx.partitionId()
        hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
        port = ""
        if me == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = str(s.getsockname()[1])
        port = ctx.allGather(port)[0]
        env = {**os.environ, "RANK": str(me), "WORLD_SIZE": str(len(hosts)),
               "LOCAL_RANK": str(hosts[:me].count(hosts[me])),
               "LOCAL_WORLD_SIZE": str(hosts.count(hosts[me])),
               "MASTER_ADDR": hosts[0], "MASTER_PORT": port}
        for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(name, None)  # as `pipeline run --nproc` does: rank 0 hosts the store
        if "gpu" in ctx.resources():
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.resources()["gpu"].addresses)
        if not binary:
            check_torch()
        done = subprocess.run([binary or pipeline_binary(), *command], cwd=cwd, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True)
        tail = "\n".join(done.stderr.strip().splitlines()[-STDERR_LINES:])
        yield me, done.returncode, done.stdout, tail

    ranks = sorted(spark.sparkContext.parallelize(range(num_processes), num_processes)
                   .barrier().mapPartitions(run_rank).collect())
    failed = [f"rank {r} exited with code {code}:\n{tail or '(no output)'}"
              for r, code, _, tail in ranks if code != 0]
    if failed:
        raise RuntimeError(f"lakeml_spark.train: {len(failed)} of {num_processes} ranks "
                           f"failed; a rerun resumes from the last checkpoint\n"
                           + "\n".join(failed))
    return [json.loads(line) for line in ranks[0][2].splitlines() if line.strip()]
