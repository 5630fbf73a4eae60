"""Install the carried wheels into a target folder: dask, distributed and dask-mpi always, every other wheel only
where the host has no distribution of that name (a newer copy of, say, packaging or pyyaml placed in front of the
host's could break torch or cupy). Usage: python3 install_wheels.py WHEEL_DIR TARGET"""

import glob
import importlib.metadata as md
import os
import re
import subprocess
import sys

ALWAYS = ("dask", "distributed", "dask_mpi")
folder, target = sys.argv[1], sys.argv[2]
pick = []
for wheel in sorted(glob.glob(os.path.join(folder, "*.whl"))):
    name = re.split(r"-\d", os.path.basename(wheel), maxsplit=1)[0]
    try:
        md.version(name.replace("_", "-"))
        missing = False
    except md.PackageNotFoundError:
        missing = True
    if missing or name in ALWAYS:
        pick.append(wheel)
subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                       "--no-cache-dir", "--upgrade", "--target", target, *pick])
print("wheels installed:", " ".join(os.path.basename(w).split("-")[0] for w in pick))
