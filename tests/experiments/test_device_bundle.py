"""experiments/device_bundle.py without the network: the set the bundle carries (what the image
lacks, nothing the image holds at another version), the names pip compares, the wheel tags
asked for, and a bad --python. The bundle itself is built by hand (it downloads)."""

import pytest

from tests.scripts import load_module


@pytest.fixture(scope="module")
def bundle():
    return load_module("experiments/device_bundle.py", "device_bundle")


def _pkg(name, version):
    return {"name": name, "version": version, "url": f"https://x/{name}-{version}.whl"}


def test_the_bundle_is_what_the_image_lacks(bundle):
    image = {"jax": _pkg("jax", "0.11.2"), "numpy": _pkg("numpy", "2.4.6")}
    wanted = {**image, "grain": _pkg("grain", "0.2.18"), "einops": _pkg("einops", "0.8.2")}
    assert bundle.missing(image, wanted) == {
        "grain": _pkg("grain", "0.2.18"),
        "einops": _pkg("einops", "0.8.2"),
    }
    assert bundle.missing(image, image) == {}


def test_a_bundle_that_would_change_the_images_packages_is_refused(bundle):
    image = {"numpy": _pkg("numpy", "2.4.6"), "jax": _pkg("jax", "0.11.2")}
    wanted = {"numpy": _pkg("numpy", "1.26.4"), "jax": _pkg("jax", "0.11.2")}
    with pytest.raises(ValueError, match=r"would change the image's packages: numpy 2.4.6 -> 1"):
        bundle.missing(image, wanted)


def test_names_compare_as_pip_compares_them(bundle):
    assert bundle.canonical("ml_collections") == bundle.canonical("ML-Collections")
    assert bundle.canonical("tensorboardX") == "tensorboardx"
    assert [bundle.canonical(n) for n in bundle.LEAVE_OUT] == ["pyarrow"]


def test_wheels_are_asked_for_the_images_python_only(bundle):
    args = bundle.target_args("3.12")
    assert args[:6] == [
        "--only-binary",
        ":all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
    ]
    platforms = args[7::2]
    assert "manylinux_2_28_x86_64" in platforms and "manylinux2014_x86_64" in platforms
    assert all(p.endswith("x86_64") for p in platforms)


def test_a_bad_python_version_is_a_usage_error(bundle, capsys):
    with pytest.raises(SystemExit) as stop:
        bundle.main(["--out", "x", "--python", "python3"])
    assert stop.value.code == 2
    assert "--python must be a version like 3.12, got 'python3'" in capsys.readouterr().err


def test_an_older_python_resolves_the_images_jax_at_its_newest_release(bundle):
    """jax 0.11 needs Python 3.12: for 3.11 (the dress rehearsal) the image's jax family is
    0.10.2, the rest as for 3.12."""
    assert bundle.image("3.12") == list(bundle.IMAGE)
    older = bundle.image("3.11")
    assert [p for p in older if p.startswith("jax")] == [
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "jax-cuda13-plugin==0.10.2",
        "jax-cuda13-pjrt==0.10.2",
    ]
    assert [p for p in older if not p.startswith("jax")] == [
        p for p in bundle.IMAGE if not p.startswith("jax")
    ]
