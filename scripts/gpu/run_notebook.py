"""Run a notebook's code cells in order, in one namespace, without Jupyter (the GPU machine has no kernel).

    python scripts/gpu/run_notebook.py notebooks/01_pgas_rechunk.ipynb

Cell outputs go to stdout; a failing cell stops the run with its traceback and exit status 1.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(path: str) -> int:
    with open(path) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__main__"}
    for i, cell in enumerate(cells, 1):
        source = "".join(cell["source"])
        print(f"--- cell {i}", flush=True)
        try:
            exec(compile(source, f"{path}:cell{i}", "exec"), namespace)
        except Exception:
            traceback.print_exc()
            return 1
    print("--- all cells ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
