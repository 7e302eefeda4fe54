"""TorchDistributor (PySpark's own launcher, local mode) runs `pipeline run` as 2 ranks
through the two-line script docs/spark.md shows.

usage: spark_torch_distributor.py PIPELINE

The binary is LAKEML_PIPELINE (the test's build). Prints JSON: {"done": true} once
TorchDistributor returned.
"""
import pathlib
import sys

from spark_common import finish, session

# docs/spark.md, "Under TorchDistributor".
TWO_LINES = """import os, sys
os.execvp(os.environ.get("LAKEML_PIPELINE", "pipeline"), ["pipeline", "run", "-q", *sys.argv[1:]])
"""


def main() -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    spark = session("spark_torch_distributor.py", lakeml=False)
    script = pathlib.Path("run_pipeline.py")
    script.write_text(TWO_LINES)
    TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(str(script), sys.argv[1])
    finish(spark, {"done": True})


if __name__ == "__main__":
    main()
