"""A folder of wheels that installs this library on the lent GPU machine, which has no package
registry: what its image lacks, for its Python, and the library's own wheel.

    python experiments/device_bundle.py --out device_bundle [--python 3.12]
    # there: pip install --no-index --no-deps device_bundle/*.whl

The image holds Python 3.12, jax 0.11.2 with the jax-cuda13 plugin, flax, optax, chex, orbax,
torch 2.11, triton 3.6, transformers 5.17, and matplotlib, pillow, pyarrow and others of the
library's dependencies (`IMAGE`; docs/guides/device_check.md), and lacks ml_collections, grain,
tensorboardX and flash-linear-attention (`WANTED`: the check compares against its Triton
kernels). pip resolves twice, from metadata only (``pip install --dry-run --report`` for the
image's Python and platform, ``--only-binary :all:``): the image's packages alone, then those
with the library's wheel and `WANTED`. The bundle is the second set less the first: every
package the image already holds stays at the image's version and out of the folder. Then
``pip download --no-deps`` fetches exactly those wheels, less `LEAVE_OUT`. The folder must
stay under the 64 MiB that can be carried to the device; the script says what it weighs and
stops (exit 1) above it. Writes ``bundle.json`` (the packages, versions and sizes, and what was
left out) into the folder. The wheels install with ``--no-deps``: the library's dependency on a
package left out is not met, and the check does not import it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = (
    "jax==0.11.2",
    "jaxlib==0.11.2",
    "jax-cuda13-plugin==0.11.2",
    "jax-cuda13-pjrt==0.11.2",
    "flax",
    "optax",
    "chex",
    "orbax-checkpoint",
    "torch==2.11.*",
    "triton==3.6.*",
    "transformers==5.17.*",
    # also there (its package list), at versions the bundle need not match: installed with
    # --no-deps, the bundle would otherwise carry them and replace the image's own
    "matplotlib",
    "pillow",
    "einops",
    "cloudpickle",
    "sentencepiece",
    "pyarrow",
)
# jax 0.11 needs Python 3.12: for an older Python (the dress rehearsal here, 3.11) the image's
# jax family is resolved at its newest release for that Python, 0.10.2 (`image`).
OLDER_PYTHON_JAX = "0.10.2"
WANTED = ("ml_collections", "grain", "tensorboardX", "flash-linear-attention", "fla-core==0.6.0")
# The image's glibc takes manylinux wheels up to 2.35 (Ubuntu 22.04 and later); pip matches
# ``--platform`` tags exactly, so each is named.
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
LIMIT_BYTES = 64 * 2**20
# Dependencies of the library that the device check never imports, too large to carry, should
# an image lack them: pyarrow reads Parquet corpora (`data.corpus`, imported there only) and
# weighs 52.5 MiB for Python 3.12 (the lent image holds it: `IMAGE`).
LEAVE_OUT = ("pyarrow",)


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image(python: str) -> list[str]:
    """`IMAGE` for ``python``: for a Python before 3.12 its jax, jaxlib and CUDA plugin at
    `OLDER_PYTHON_JAX`."""
    if tuple(map(int, python.split("."))) >= (3, 12):
        return list(IMAGE)
    return [
        re.sub(r"==0\.11\.2$", f"=={OLDER_PYTHON_JAX}", p) if p.startswith("jax") else p
        for p in IMAGE
    ]


def target_args(python: str) -> list[str]:
    """pip's arguments that pick wheels for the image's Python and platform."""
    args = ["--only-binary", ":all:", "--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def resolve(requirements: list[str], python: str) -> dict[str, dict]:
    """``{canonical name: {"name", "version", "url"}}``: what pip installs for
    ``requirements`` on the image's Python, resolved from metadata (nothing installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
        command += ["--quiet", "--report", report, "--target", os.path.join(tmp, "t")]
        command += ["--ignore-requires-python"]  # pip checks its own Python otherwise
        subprocess.run(command + target_args(python) + requirements, check=True)
        with open(report) as f:
            installs = json.load(f)["install"]
    return {
        canonical(i["metadata"]["name"]): {
            "name": i["metadata"]["name"],
            "version": i["metadata"]["version"],
            "url": i["download_info"]["url"],
        }
        for i in installs
    }


def missing(image: dict[str, dict], wanted: dict[str, dict]) -> dict[str, dict]:
    """The packages of ``wanted`` that ``image`` does not hold at the same version. One held
    at another version is an error: the bundle would replace the image's own."""
    changed = [
        f"{found['name']} {image[key]['version']} -> {found['version']}"
        for key, found in wanted.items()
        if key in image and image[key]["version"] != found["version"]
    ]
    if changed:
        raise ValueError(f"the bundle would change the image's packages: {', '.join(changed)}")
    return {key: found for key, found in wanted.items() if key not in image}


def build(out: Path, python: str, log=print) -> dict:
    """Write the bundle into ``out`` (see the module docstring); its ``bundle.json``."""
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)], check=True)
    own = next(out.glob("linear_attention-*.whl"))
    image_pins = image(python)
    held = resolve(image_pins, python)
    wanted = resolve([*image_pins, *WANTED, str(own)], python)
    bundle = missing(held, wanted)
    bundle.pop("linear-attention", None)  # its wheel is built, not downloaded
    left_out = {
        key: bundle.pop(key)["version"] for key in map(canonical, LEAVE_OUT) if key in bundle
    }
    pins = [f"{p['name']}=={p['version']}" for p in bundle.values()]
    log(f"{len(pins)} packages the image lacks: {', '.join(sorted(pins))}")
    download = pip + ["download", "--no-deps", "--quiet", "-d", str(out)]
    subprocess.run(download + target_args(python) + pins, check=True)
    wheels = sorted(out.glob("*.whl"))
    sizes = {w.name: w.stat().st_size for w in wheels}
    record = {
        "python": python,
        "image": image_pins,
        "wanted": list(WANTED),
        "left_out": left_out,
        "wheels": sizes,
        "bytes": sum(sizes.values()),
        "limit_bytes": LIMIT_BYTES,
        "install": f"pip install --no-index --no-deps {out.name}/*.whl",
    }
    (out / "bundle.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder of wheels (git-ignored)")
    parser.add_argument("--python", default="3.12", help="the image's Python (default 3.12)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.[0-9]+", args.python):
        parser.error(f"--python must be a version like 3.12, got {args.python!r}")
    record = build(Path(args.out), args.python)
    weight = f"{record['bytes'] / 2**20:.1f} MiB in {len(record['wheels'])} wheels"
    if record["bytes"] > LIMIT_BYTES:
        print(f"device_bundle: {weight}: over the 64 MiB that reach the device", file=sys.stderr)
        return 1
    print(f"device_bundle: {weight} in {args.out}; there: {record['install']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
