"""Compare lakeml's embeddings tables with sentence-transformers' `model.encode` of the same
texts and model, and answer a nearest-neighbour query with numpy.

usage: embed_reference.py REVIEWS_TABLE CASES_JSON
CASES_JSON: [{"table": path, "model": dir, "dims": n, "normalize": bool}, ...]
prints JSON: per case the rows, ids_equal, min_cosine, max_abs_diff, the arrow type of
`embedding` (int8 vectors are compared as `embedding * embedding_scale`); and for the first case the vector of id 7 and numpy's 5 nearest ids to it by
cosine distance (ties by id); for a table named `half` (the first case in bf16), the
cosine to the first case's vectors and the top-10 overlap of every row's neighbours.
"""
import json
import sys

import deltalake
import numpy as np
from sentence_transformers import SentenceTransformer


def main() -> None:
    reviews = deltalake.DeltaTable(sys.argv[1]).to_pyarrow_table().to_pylist()
    text = {r["id"]: r["text"] for r in reviews}
    out = []
    out_vectors = []  # the first case's vectors: the fp32 reference of the bf16 case
    for case in json.loads(sys.argv[2]):
        table = deltalake.DeltaTable(case["table"]).to_pyarrow_table()
        kind = str(table.schema.field("embedding").type)
        rows = sorted(table.to_pylist(), key=lambda r: r["id"])
        ids = [r["id"] for r in rows]
        ours = np.array([r["embedding"] for r in rows], dtype=np.float32)
        if "embedding_scale" in table.column_names:
            ours *= np.array([r["embedding_scale"] for r in rows], dtype=np.float32)[:, None]
        model = SentenceTransformer(case["model"], device="cpu")
        theirs = model.encode([text[i] for i in ids], batch_size=32, convert_to_numpy=True)
        theirs = theirs[:, : case["dims"]]
        if case["normalize"]:
            theirs = theirs / np.linalg.norm(theirs, axis=1, keepdims=True)
        cosine = (ours * theirs).sum(1) / (
            np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
        result = {
            "table": case["table"],
            "rows": len(ids),
            "ids_equal": ids == sorted(text),
            "type": kind,
            "lengths": sorted({len(r["embedding"]) for r in rows}),
            "min_cosine": float(cosine.min()),
            "max_abs_diff": float(np.abs(ours - theirs).max()),
            "norms": [float(np.linalg.norm(ours, axis=1).min()),
                      float(np.linalg.norm(ours, axis=1).max())],
        }
        if out and case["table"].endswith("half"):
            fp32 = out_vectors[0]

            def top10(v):
                s = v @ v.T
                return [set(np.argsort(-row, kind="stable")[:10]) for row in s]

            a, b = top10(ours), top10(fp32)
            result["top10_overlap_with_fp32"] = float(
                sum(len(x & y) for x, y in zip(a, b)) / (10 * len(a)))
            result["min_cosine_to_fp32"] = float(((ours * fp32).sum(1) / (
                np.linalg.norm(ours, axis=1) * np.linalg.norm(fp32, axis=1))).min())
        if not out:
            out_vectors.append(ours)
            q = ours[ids.index(7)]
            distance = 1.0 - (ours @ q) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(q))
            order = sorted(range(len(ids)), key=lambda j: (distance[j], ids[j]))
            result["query"] = [float(x) for x in q]
            result["nearest"] = [ids[j] for j in order[:5]]
        out.append(result)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
