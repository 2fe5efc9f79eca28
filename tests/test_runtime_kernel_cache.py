"""kernel_cache: a kept image is loaded instead of compiled; any change to what decides its bytes is another
file; a torn, truncated or flipped file is compiled again and replaced, never loaded; a folder that cannot be
written costs only the compile. Real files; the compile is a counting stand-in (CI has no GPU). The GPU side
(a kernel loaded from its kept image runs as the compiled one) is in tests/test_runtime_gpu.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from moet_cache.runtime import kernel_cache
from moet_cache.runtime.kernel_cache import Image, cached_image, folder, image_path, read_image, write_image

SOURCE = "__global__ void k(int* p) { *p = 1; }"
ARGS = (SOURCE, "k", "90", ("-std=c++17",), "torch 2.14 cuda 12.8 nvrtc 12.8")


class _Compiler:
    def __init__(self, data: bytes = b"\x7fELF cubin bytes \x00\n\xff" * 1000) -> None:
        self.calls = 0
        self.data = data

    def __call__(self) -> Image:
        self.calls += 1
        return Image("_Z1kPi", self.data)


def test_kept_image_is_loaded_not_compiled(tmp_path: Path) -> None:
    compile_image = _Compiler()
    first = cached_image(*ARGS, compile_image, tmp_path)
    again = cached_image(*ARGS, compile_image, tmp_path)
    assert compile_image.calls == 1
    assert again == first == Image("_Z1kPi", compile_image.data)
    assert [p.name for p in tmp_path.iterdir()] == [image_path(tmp_path, *ARGS).name]  # no temp file left


@pytest.mark.parametrize("index, other", [(0, SOURCE + " "), (1, "k2"), (2, "120"),
                                          (3, ("-std=c++17", "-DX=1")), (4, "torch 2.14 cuda 12.8 nvrtc 12.9")])
def test_every_input_of_the_compile_names_another_file(tmp_path: Path, index: int, other) -> None:
    changed = list(ARGS)
    changed[index] = other
    assert image_path(tmp_path, *changed) != image_path(tmp_path, *ARGS)
    compile_image = _Compiler()
    cached_image(*ARGS, compile_image, tmp_path)
    cached_image(*changed, compile_image, tmp_path)
    assert compile_image.calls == 2


def _damage_cases(raw: bytes) -> dict[str, bytes]:
    flipped = bytearray(raw)
    flipped[-100] ^= 0x01  # one bit of the image
    return {"a bit of the image flipped": bytes(flipped), "truncated": raw[:-1],
            "torn in the header": raw[:30], "empty": b"", "another file": b"\x7fELF" + raw[4:],
            "header not JSON": raw.replace(b'"mangled"', b"mangled", 1)}


@pytest.mark.parametrize("case", list(_damage_cases(b"x" * 200)))
def test_damaged_image_is_compiled_again_and_replaced(tmp_path: Path, case: str) -> None:
    compile_image = _Compiler()
    cached_image(*ARGS, compile_image, tmp_path)
    path = image_path(tmp_path, *ARGS)
    path.write_bytes(_damage_cases(path.read_bytes())[case])
    assert read_image(path) is None
    assert cached_image(*ARGS, compile_image, tmp_path) == Image("_Z1kPi", compile_image.data)
    assert compile_image.calls == 2
    assert read_image(path) == Image("_Z1kPi", compile_image.data)  # replaced by a sound one


def test_oversized_or_linked_image_is_not_read(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "a.kernel"
    assert write_image(path, Image("m", b"x" * 1000))
    monkeypatch.setattr(kernel_cache, "_MAX_FILE", 100)  # read_all's limit: the library's InputError
    assert read_image(path) is None
    monkeypatch.undo()
    link = tmp_path / "b.kernel"
    link.symlink_to(path)  # never followed (fsutil.open_regular)
    assert read_image(path) == Image("m", b"x" * 1000) and read_image(link) is None


def test_unwritable_folder_costs_only_the_compile(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    where = blocker / "kernels"  # its parent is a file: cannot be created, whoever runs the test
    compile_image = _Compiler()
    assert cached_image(*ARGS, compile_image, where) == Image("_Z1kPi", compile_image.data)
    assert cached_image(*ARGS, compile_image, where).data == compile_image.data
    assert compile_image.calls == 2
    assert write_image(image_path(where, *ARGS), Image("m", b"x")) is False


def test_no_folder_keeps_nothing(tmp_path: Path) -> None:
    compile_image = _Compiler()
    cached_image(*ARGS, compile_image, None)
    cached_image(*ARGS, compile_image, None)
    assert compile_image.calls == 2


def test_folder_from_the_environment(tmp_path: Path) -> None:
    assert folder({kernel_cache.ENV: str(tmp_path)}) == tmp_path
    for off in ("off", "OFF", "", "0", "none"):
        assert folder({kernel_cache.ENV: off}) is None
    assert folder({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/moet-cache/kernels")
    assert folder({}) == Path.home() / ".cache" / "moet-cache" / "kernels"
    assert folder({"XDG_CACHE_HOME": ""}) == Path.home() / ".cache" / "moet-cache" / "kernels"


def test_image_round_trip_keeps_every_byte(tmp_path: Path) -> None:
    data = bytes(range(256)) * 64 + b"\n\n"  # newlines and NULs inside the image
    path = tmp_path / "a.kernel"
    assert write_image(path, Image("_Z3fooILi2ELb1EEvPKt", data)) is True
    assert read_image(path) == Image("_Z3fooILi2ELb1EEvPKt", data)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)


def test_toolchain_names_torch() -> None:
    import torch

    assert f"torch {torch.__version__}" in kernel_cache.toolchain()


def test_load_kernel_compiles_once_through_torchs_helpers(tmp_path: Path, monkeypatch) -> None:
    """load_kernel hands torch's NVRTC helper the source, instantiation, architecture and options and keeps
    the image; a second call (load_kernel holds nothing in memory: mma_moe.compiled does) loads it without
    compiling."""
    import torch.cuda._utils as cuda_utils

    calls: list[tuple] = []

    def fake_compile(source, name, *positional, compute_capability=None, nvcc_options=None, **other):
        # by keyword only: the parameter after compute_capability differs between torch versions
        calls.append((source, name, positional, compute_capability, nvcc_options, other))
        return b"\x7fELF image", "_Z1kPi"

    loaded: list[tuple] = []

    def fake_load(data, names):
        loaded.append((data, names))
        return {n: ("kernel", data) for n in names}

    monkeypatch.setattr(cuda_utils, "_nvrtc_compile", fake_compile)
    monkeypatch.setattr(cuda_utils, "_cuda_load_module", fake_load)
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    for _ in range(2):
        assert kernel_cache.load_kernel(SOURCE, "k", "120", ("-std=c++17",)) == ("kernel", b"\x7fELF image")
    assert calls == [(SOURCE, "k", (), "120", ["-std=c++17"], {})]
    assert loaded == [(b"\x7fELF image", ["_Z1kPi"])] * 2
    assert len(list(tmp_path.iterdir())) == 1


_OTHER_UID = 54321  # no user of this machine: a file root gives it is another user's


def _plant(where: Path) -> Path:
    """A sound image (its digest matches) at the file cached_image would read, not the compiler's."""
    path = image_path(where, *ARGS)
    assert write_image(path, Image("_Z1kPi", b"planted code"))
    return path


def _refused(where: Path, caplog, what: str) -> None:
    """cached_image compiles, neither loads nor replaces the planted image, and says why in one line."""
    path = image_path(where, *ARGS)
    before = path.read_bytes()
    compile_image = _Compiler()
    with caplog.at_level("WARNING", logger=kernel_cache.__name__):
        assert cached_image(*ARGS, compile_image, where) == Image("_Z1kPi", compile_image.data)
        assert cached_image(*ARGS, compile_image, where).data == compile_image.data
    assert compile_image.calls == 2
    assert path.read_bytes() == before  # another user's file is left as it is
    lines = [r.getMessage() for r in caplog.records if r.name == kernel_cache.__name__]
    assert len(lines) == 1, lines  # once, not at every kernel
    assert str(where) in lines[0] and what in lines[0] and kernel_cache.ENV in lines[0]
    assert "\n" not in lines[0]
    kernel_cache._say_once.cache_clear()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=oct)
def test_folder_others_may_write_is_refused(tmp_path: Path, caplog, mode: int) -> None:
    where = tmp_path / "kernels"
    _plant(where)
    os.chmod(where, mode)
    _refused(where, caplog, f"writable by other users (mode {mode:03o})")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_folder_of_another_user_is_refused(tmp_path: Path, caplog) -> None:
    where = tmp_path / "kernels"
    path = _plant(where)
    os.chown(where, _OTHER_UID, -1)
    os.chown(path, _OTHER_UID, -1)
    _refused(where, caplog, f"owned by uid {_OTHER_UID}")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_link_to_another_users_folder_is_refused(tmp_path: Path, caplog) -> None:
    theirs = tmp_path / "theirs"
    _plant(theirs)
    os.chown(theirs, _OTHER_UID, -1)
    where = tmp_path / "kernels"
    where.symlink_to(theirs)  # the folder the images would come from is theirs
    _refused(where, caplog, f"owned by uid {_OTHER_UID}")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_image_file_of_another_user_is_refused(tmp_path: Path, caplog) -> None:
    os.chmod(tmp_path, 0o700)
    os.chown(_plant(tmp_path), _OTHER_UID, -1)
    _refused(tmp_path, caplog, f"owned by uid {_OTHER_UID}")


def test_image_file_others_may_write_is_refused(tmp_path: Path, caplog) -> None:
    os.chmod(tmp_path, 0o700)
    os.chmod(_plant(tmp_path), 0o646)
    _refused(tmp_path, caplog, "writable by other users (mode 646)")


def test_missing_folder_is_created_for_this_user_alone(tmp_path: Path, caplog) -> None:
    where = tmp_path / "a" / "kernels"
    compile_image = _Compiler()
    with caplog.at_level("WARNING", logger=kernel_cache.__name__):
        cached_image(*ARGS, compile_image, where)
        cached_image(*ARGS, compile_image, where)
    assert compile_image.calls == 1 and not caplog.records
    st = os.stat(where)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
