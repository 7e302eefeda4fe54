"""Compare two safetensors files tensor by tensor.

usage: compare_weights.py A B
prints JSON: names_equal, max_abs_diff over all tensors, tensors.
"""
import json
import sys

from safetensors.torch import load_file


def main() -> None:
    a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
    diff = max(((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b), default=0.0)
    print(json.dumps({"names_equal": sorted(a) == sorted(b), "max_abs_diff": diff, "tensors": len(a)}))


if __name__ == "__main__":
    main()
