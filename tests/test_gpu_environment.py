"""The GPU settings the trainer puts in its environment before JAX starts the GPU backend."""

from maxfp4.distributed import GPU_ENVIRONMENT_DEFAULTS, set_gpu_environment_defaults


def test_defaults_fill_only_what_the_environment_leaves_unset():
    env = {"PATH": "/bin"}
    assert set_gpu_environment_defaults(env) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert env == {"PATH": "/bin", **GPU_ENVIRONMENT_DEFAULTS}

    mine = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert set_gpu_environment_defaults(mine) == {}
    assert mine == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}  # a user's own value wins
