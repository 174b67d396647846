import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Small ops get much slower when threads are oversubscribed: use exactly what the machine has.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


# ---------------------------------------------------------------- tiny diffusers folders (read-only: copy before editing)
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory):
    """A tiny Wan 2.1 pipeline folder (WanPipeline.from_pretrained loads it), built once per session."""
    from slidefusion.testing.tiny import save_tiny_wan_pipeline

    return save_tiny_wan_pipeline(tmp_path_factory.mktemp("tiny-wan") / "wan")


@pytest.fixture(scope="session")
def tiny_wan_sharded_dir(tmp_path_factory):
    """The same pipeline with its transformer in several safetensors shards (with an index)."""
    from slidefusion.testing.tiny import save_tiny_wan_pipeline

    return save_tiny_wan_pipeline(tmp_path_factory.mktemp("tiny-wan-sharded") / "wan", max_shard_size="10KB")


@pytest.fixture(scope="session")
def tiny_wan_variant_dir(tmp_path_factory):
    """A function variant -> folder for Wan 2.2 layouts ("2.2-ti2v", "2.2-a14b"), each built once."""
    from slidefusion.testing.tiny import save_tiny_wan_pipeline

    built = {}

    def folder(variant):
        if variant not in built:
            built[variant] = save_tiny_wan_pipeline(tmp_path_factory.mktemp(f"tiny-wan-{variant}") / "wan", variant)
        return built[variant]

    return folder


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory, tiny_wan_dir):
    """A function family -> a tiny pipeline folder of that family (`slidefusion.testing.pipelines`),
    each built once per session; "wan" is `tiny_wan_dir`."""
    from slidefusion.testing.pipelines import save_tiny_pipeline

    built = {"wan": tiny_wan_dir}

    def folder(family):
        if family not in built:
            built[family] = save_tiny_pipeline(tmp_path_factory.mktemp(f"tiny-{family}") / family, family)
        return built[family]

    return folder
