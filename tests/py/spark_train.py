"""lakeml_spark.train: `pipeline run` as 2 ranks on the barrier tasks of Spark local[2].

usage: spark_train.py PIPELINE

The binary is LAKEML_PIPELINE (the test's build), run in this process's working directory.
Prints JSON: kinds (the kinds of the stage reports rank 0 printed) and train (its train
report).
"""
import sys

from spark_common import finish, session


def main() -> None:
    import lakeml_spark

    spark = session("spark_train.py", lakeml=False)
    reports = lakeml_spark.train(spark, sys.argv[1], num_processes=2)
    train = next(r for r in reports if r["kind"] == "train")
    finish(spark, {"kinds": [r["kind"] for r in reports], "train": train})


if __name__ == "__main__":
    main()
