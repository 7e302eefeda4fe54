"""Reads MLflow runs back with MLflow's own Python client; prints JSON.

Usage: mlflow_runs.py TRACKING_URI DOWNLOAD_DIR RUN_ID...

For each run prints its status, experiment, params, the full history of every metric and
its artifacts, which are downloaded through the server into DOWNLOAD_DIR/RUN_ID/.
Metric values are written as repr() strings ("0.1", "nan", "inf"), which the caller
parses exactly; JSON numbers cannot hold NaN, and not every JSON parser rounds correctly.
"""

import json
import os
import sys

from mlflow.tracking import MlflowClient


def artifact_files(client, run_id, path=None):
    out = []
    for info in client.list_artifacts(run_id, path):
        if info.is_dir:
            out += artifact_files(client, run_id, info.path)
        else:
            out.append(info.path)
    return out


def main():
    uri, download_dir, run_ids = sys.argv[1], sys.argv[2], sys.argv[3:]
    client = MlflowClient(tracking_uri=uri)
    runs = {}
    for run_id in run_ids:
        run = client.get_run(run_id)
        history = {
            key: [[m.step, repr(m.value), m.timestamp]
                  for m in client.get_metric_history(run_id, key)]
            for key in run.data.metrics
        }
        files = sorted(artifact_files(client, run_id))
        if files:
            dst = os.path.join(download_dir, run_id)
            os.makedirs(dst, exist_ok=True)
            client.download_artifacts(run_id, "", dst)
        runs[run_id] = {
            "status": run.info.status,
            "run_name": run.info.run_name,
            "experiment": client.get_experiment(run.info.experiment_id).name,
            "start_time": run.info.start_time,
            "end_time": run.info.end_time,
            "params": run.data.params,
            "history": history,
            "artifacts": files,
        }
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
