"""Paths named by clients are confined to the roots given at start (expertmesh/paths.py): ``..``
and symlinks are resolved first, a sibling whose name starts like a root is not under it, no
roots allow nothing; the LoRA service also confines the files it reads from an adapter
directory. (Over gRPC and HTTP: tests/test_admin_cli.py, test_lora_cluster.py, test_http_lora.py.)"""

from __future__ import annotations

import os

import pytest

from coordinator.lora.service import LoRAPermissionError, LoRAService
from expertmesh.paths import PathNotAllowed, confine, resolve_roots


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "adapters", tmp_path / "secret"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (tmp_path / "adapters-evil").mkdir()  # shares the root's name as a prefix
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    (root / "link-in").symlink_to(root / "a", target_is_directory=True)
    return tmp_path, root, outside


def test_paths_under_a_root_are_allowed_and_resolved(tree):
    tmp, root, _ = tree
    roots = resolve_roots([root])
    assert confine(str(root / "a"), roots, "adapter path", "--lora-dir") == (root / "a").resolve()
    assert confine(root, roots, "x", "--f") == root.resolve()
    assert confine(str(root / "link-in"), roots, "x", "--f") == (root / "a").resolve()
    assert confine(str(root / "a" / ".." / "a"), roots, "x", "--f") == (root / "a").resolve()
    old = os.getcwd()
    try:  # a relative path is taken from the server's working directory
        os.chdir(tmp)
        assert confine("adapters/a", roots, "x", "--f") == (root / "a").resolve()
    finally:
        os.chdir(old)


@pytest.mark.parametrize(
    "rel",
    ["secret", "adapters/../secret", "adapters/a/../../secret", "adapters/link-out", "adapters-evil", "/etc"],
)
def test_paths_outside_every_root_are_refused(tree, rel):
    tmp, root, _ = tree
    with pytest.raises(PathNotAllowed, match="not under a --lora-dir root"):
        confine(str(tmp / rel), resolve_roots([root]), "adapter path", "--lora-dir")


def test_no_roots_allow_nothing(tree):
    _, root, _ = tree
    with pytest.raises(PathNotAllowed, match=r"none given \(--lora-dir\)"):
        confine(str(root / "a"), (), "adapter path", "--lora-dir")
    with pytest.raises(PathNotAllowed, match="empty path"):
        confine("", resolve_roots([root]), "adapter path", "--lora-dir")


def test_the_lora_service_confines_the_files_it_reads_too(tree):
    _, root, outside = tree
    svc = LoRAService(None, (str(root),), None, None)  # type: ignore[arg-type]  # check_path only
    assert svc.check_path(str(root / "a")) == (root / "a").resolve()
    (outside / "adapter_model.safetensors").write_bytes(b"not yours")
    (root / "a" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(LoRAPermissionError, match="adapter file"):
        svc.check_path(str(root / "a"))
    with pytest.raises(LoRAPermissionError, match="--lora-dir"):
        svc.check_path(str(root / "link-out"))
    assert isinstance(
        LoRAPermissionError("x"), PermissionError
    )  # the servicers map it to 403 / PERMISSION_DENIED
