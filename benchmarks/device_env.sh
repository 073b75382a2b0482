# Sourced (from the repo root) by the scripts that run on a GPU machine. Packages the GPU image
# lacks (grain, array-record, ...) travel as wheels in .whl/: install them beside the image's
# own packages and put them and the repo on PYTHONPATH. Unbuffered output, so logs stream.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
