import pytest

from harness.runtime.platform import parse_oom
from harness.spec.units import GIB, MIB, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16 GB", 16 * 10**9),
        ("64GB", 64 * 10**9),
        ("23.52 GiB", int(23.52 * GIB)),
        ("512 MiB", 512 * MIB),
        ("1024 B", 1024),
        (2048, 2048),
        ("1.45 GiB", int(1.45 * GIB)),
    ],
)
def test_parse_size_reads_units_as_vendors_and_torch_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["16 GX", "lots", "-3 GB", "", True, -1, float("nan"), float("inf"), 2**70,
                                 "9999999999 TiB"])
def test_parse_size_rejects_what_is_not_a_size(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_a_size_written_without_a_unit_is_refused_with_the_unit_to_write():
    with pytest.raises(ValueError, match="'64' has no unit; write 64GiB"):
        parse_size("64")


def test_cuda_oom_of_guide_003_is_parsed_with_its_size():
    oom = parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has ...")
    assert oom.platform == "cuda"
    assert oom.tried_to_allocate == int(2.32 * GIB)


def test_hip_oom_of_guide_000_is_parsed_as_hip():
    oom = parse_oom("RuntimeError: HIP out of memory. Tried to allocate 1.45 GiB (GPU 3; 63.98 GiB total)")
    assert oom.platform == "hip"
    assert oom.tried_to_allocate == int(1.45 * GIB)


def test_oom_of_guide_004_in_mib():
    oom = parse_oom("CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a total capacity of 23.52 GiB")
    assert oom.tried_to_allocate == 32 * MIB


def test_cpu_allocator_failure_is_an_oom():
    oom = parse_oom("RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: "
                    "you tried to allocate 123456 bytes.")
    assert oom.platform == "cpu" and oom.tried_to_allocate == 123456


def test_other_errors_are_not_ooms():
    assert parse_oom("ValueError: shapes (2,3) and (4,5) not aligned") is None


def test_a_cublas_handle_that_cannot_be_allocated_is_an_oom():
    oom = parse_oom("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert oom is not None and oom.platform == "cuda" and oom.tried_to_allocate is None


def test_a_host_without_a_gpu_drivers_device_files_is_the_cpu_and_torch_is_not_imported():
    """Found without torch, whose import costs each harness process that runs only tiny cases 1.8 s."""
    import subprocess
    import sys

    code = ("import sys\nfrom harness.runtime import platform\n"
            "platform.DEVICE_FILES = (sys.argv[1] + '/nvidia*',)\n"
            "print(platform.detect().value, platform.accelerator_count(), 'torch' in sys.modules)\n")
    with_none = subprocess.run([sys.executable, "-c", code, "/nonexistent-dev"], capture_output=True, text=True,
                               check=True)
    assert with_none.stdout.split() == ["cpu", "0", "False"]


def test_a_host_with_a_gpu_drivers_device_file_asks_torch(tmp_path, monkeypatch):
    """A device file is no card: torch decides (here, where it finds none, the CPU)."""
    import torch

    from harness.runtime import platform

    (tmp_path / "kfd").touch()
    monkeypatch.setattr(platform, "DEVICE_FILES", (str(tmp_path / "nvidia*"), str(tmp_path / "kfd")))
    assert not platform.no_device_files()
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or False)
    assert platform.detect() == platform.Platform.cpu and platform.accelerator_count() == 0
    assert len(asked) == 2
    monkeypatch.setattr(platform, "DEVICE_FILES", (str(tmp_path / "nvidia*"),))
    assert platform.no_device_files()
    assert platform.detect() == platform.Platform.cpu and len(asked) == 2
