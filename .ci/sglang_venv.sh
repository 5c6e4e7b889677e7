# Sourced by .ci/run: defines `sglang_venv DIR`, which builds SGLang's CPU venv in DIR once per machine.
#
# SGLang 0.5.23 runs on its CPU platform here (SGLANG_USE_CPU_ENGINE=1, torch_native attention), but its
# declared dependencies pull CUDA-only wheels (sglang-kernel, flashinfer, ...) that do nothing on CPU. So
# sglang is installed with --no-deps and only what the server imports is added, each pinned. torch 2.14.1
# (the version sglang 0.5.23 was built against; the CUDA build runs on CPU) comes from the machine's local
# wheel cache. sgl_kernel is not installed: miles_lp/rollout/sglang_cpu/shim provides the two bookkeeping
# ops SGLang's CPU path imports from it (see that package). The interpreter is what MILES_LP_SGLANG_PYTHON
# names for the tests.
#
# Like vllm_venv in .ci/run: the folder name carries the pin; a venv that imports sglang is reused as it is
# (nothing of miles-lp is installed into it: the server gets the checkout on its PYTHONPATH); a folder that does
# not import sglang is rebuilt only if this function made it (its marker file, written right after
# `python3 -m venv`), any other folder is refused, named, and left as it was. A cold build took about 15 min on
# this machine with its 2 cores shared by other builds (6.3 GB; the torch 2.14.1 CUDA build and its libraries
# are most of it).

SGLANG_VENV_MARKER=.miles-lp-ci-sglang-venv
SGLANG_VERSION=0.5.23
# sglang-router (the Rust router a stock SGLang deployment puts in front of its servers): its Python needs
# (aiohttp, fastapi, orjson, setproctitle, uvicorn) are the server's own, pinned above
SGLANG_ROUTER="sglang-router==0.3.2"
SGLANG_TORCH=torch==2.14.1
# what the server imports on its CPU path (found by starting it: each missing import added), pinned to what the
# measured build resolved; sglang's own pins where it has them. torchvision is the build of torch 2.14.1 (installed
# --no-deps: it would pull torch's CUDA libraries again); SGLang imports it at start for its multimodal configs.
SGLANG_SERVER_DEPS=(
    "transformers==5.19.0" "tokenizers==0.23.2" "xgrammar==0.2.7" "openai==2.8.0" "openai-harmony==0.0.4"
    "compressed-tensors==0.18.0" "blobfile==3.0.0" "sentencepiece==0.2.1" "soundfile==0.13.1"
    "aiohttp==3.14.5" "anthropic==2.15.0" "distro==1.9.0" "einops==0.8.2" "fastapi==0.165.0" "interegular==0.3.3"
    "ipython==9.18.1" "msgspec==0.23.0" "numpy==2.4.6" "orjson==3.13.0" "packaging==26.4"
    "partial-json-parser==0.2.1.1.post7" "pillow==13.0.0" "prometheus_client==0.26.0" "psutil==7.2.2"
    "pybase64==1.5.1" "pydantic==2.14.4" "python-dateutil==2.9.0.post0" "python-multipart==0.0.34"
    "pyzmq==27.3.0" "regex==2026.11.19" "requests==2.34.2" "scipy==1.17.1" "setproctitle==1.3.8"
    "tiktoken==0.14.0" "torch_memory_saver==0.0.10" "tqdm==4.70.1" "uvicorn==0.54.0" "uvloop==0.23.0"
    "watchfiles==1.3.0" "xxhash==4.1.0" "zstandard==0.25.0" "dill==0.4.1" "jsonschema==4.26.0"
    "safetensors==0.8.0" "PyYAML==6.0.4" "gguf==0.19.0"
)

sglang_router_into() {  # $1: a venv this file built; adds the router to it once (an older build lacks it)
    local venv="$1"
    if "$venv/bin/python" -c "import sglang_router.router" 2>/dev/null || [ ! -f "$venv/$SGLANG_VENV_MARKER" ]; then
        return 0  # there already, or not ours to change (tests of the router then skip, saying why)
    fi
    "$venv/bin/python" -m pip install -q --no-deps "$SGLANG_ROUTER"
}

sglang_venv() {  # $1: the venv folder; builds it (or rebuilds one this function made) unless it imports sglang
    local venv="$1"
    if "$venv/bin/python" -c "import sglang" 2>/dev/null; then
        sglang_router_into "$venv"
        return
    fi
    if [ -e "$venv" ] || [ -L "$venv" ]; then
        if [ -f "$venv/$SGLANG_VENV_MARKER" ] && [ ! -L "$venv" ]; then
            echo "ci: $venv (built by .ci/sglang_venv.sh) does not import sglang: rebuilding it" >&2
            rm -rf "$venv"
        elif [ -d "$venv" ] && [ ! -L "$venv" ] && [ -z "$(ls -A "$venv")" ]; then
            :  # an empty folder: nothing to lose, the venv is made in it
        else
            echo "ci: $venv does not import sglang and was not built by .ci/sglang_venv.sh (no" \
                 "$venv/$SGLANG_VENV_MARKER): not removing it. Repair it (its python must import sglang), remove it" \
                 "yourself, or point MILES_LP_SGLANG_VENV at a new folder (or set MILES_LP_CI_SKIP_SGLANG=1)" >&2
            return 1
        fi
    fi
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    printf 'made by .ci/sglang_venv.sh on %s; removed and rebuilt by it when it does not import sglang\n' \
        "$(date -u +%FT%TZ)" > "$venv/$SGLANG_VENV_MARKER"
    "$venv/bin/python" -m pip install -q "$SGLANG_TORCH"
    "$venv/bin/python" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
    "$venv/bin/python" -m pip install -q "$SGLANG_TORCH" "${SGLANG_SERVER_DEPS[@]}"
    "$venv/bin/python" -m pip install -q --no-deps "torchvision==0.29.1"
    sglang_router_into "$venv"
}
