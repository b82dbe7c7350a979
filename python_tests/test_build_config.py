"""The build's decisions (build_support/, used by setup.py): architecture lists, finding the CUDA
toolkit and its library headers, version checks, and what gets built when.

Pure functions only: fake toolkits in temporary folders and fake nvcc/torch facts, so that these run
on any machine, with or without CUDA.
"""
import os
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # build_support/ is part of the source tree, not of the installed package

from build_support import cuda_arch, cuda_toolkit, cxx_runtime, layout  # noqa: E402
from build_support.cuda_arch import Arch, ArchError  # noqa: E402
from build_support.cuda_toolkit import HeaderSearch, RootChoice, Toolkit  # noqa: E402
from build_support.plan import BuildConfigError, TorchInfo, plan_build  # noqa: E402

TORCH_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14 +cu130
NVCC_13_ARCHS = {75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121}
CUDA_TORCH = TorchInfo("2.14.1+cu130", "13.0", None, TORCH_ARCHS)
CPU_TORCH = TorchInfo("2.13.0+cpu", None)


def _arch_list(text):
    return cuda_arch.format_arch_list(cuda_arch.parse_arch_list(text))


# --- architecture lists -------------------------------------------------------------------------------------

def test_arch_list_reads_torch_syntax():
    assert _arch_list("8.0;8.6+PTX") == "8.0;8.6+PTX"
    assert _arch_list(" 9.0 8.0 ") == "8.0;9.0"  # spaces separate too, and the result is sorted
    assert _arch_list("8.6;8.6+PTX;8.6") == "8.6+PTX"  # a duplicate keeps PTX when any entry asks for it
    assert _arch_list("Ampere;Hopper") == "8.0;8.6+PTX;9.0+PTX"
    assert _arch_list("9.0a;10.0") == "9.0a;10.0"
    assert cuda_arch.parse_arch_list("12.0+PTX") == [Arch(120, "", True)]


@pytest.mark.parametrize("text", ["sm_80", "8", "8.0+ptx", "compute_90", ";"])
def test_arch_list_rejects_what_it_cannot_read(text):
    with pytest.raises(ArchError, match="TORCH_CUDA_ARCH_LIST"):
        cuda_arch.parse_arch_list(text)


def test_gencode_flags_embed_sass_per_arch_and_ptx_where_asked():
    assert cuda_arch.gencode_flags(cuda_arch.parse_arch_list("8.6;8.9+PTX")) == [
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_89,code=sm_89",
        "-gencode=arch=compute_89,code=compute_89",
    ]


def test_nvcc_gpu_arch_listing_is_parsed():
    assert cuda_arch.parse_nvcc_gpu_archs("compute_75\ncompute_80\ncompute_100\ncompute_121\n") == {75, 80, 100, 121}


def test_default_is_torchs_list_that_the_kernels_and_nvcc_support_with_ptx_of_the_newest():
    archs, notes = cuda_arch.default_archs(TORCH_ARCHS, NVCC_13_ARCHS, "13.0")
    assert cuda_arch.format_arch_list(archs) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX" and notes == []
    # nvcc that cannot target the newest: left out with a note, PTX moves to the newest one kept.
    archs, notes = cuda_arch.default_archs(TORCH_ARCHS, NVCC_13_ARCHS - {120}, "12.6")
    assert cuda_arch.format_arch_list(archs) == "7.5;8.0;8.6;9.0;10.0+PTX"
    assert any("sm_120" in note and "nvcc 12.6" in note for note in notes)
    # A torch built for Volta with nvcc 12 (which still targets sm_70) keeps it; nvcc 13 leaves it out.
    archs, notes = cuda_arch.default_archs(["sm_60", "sm_70", "sm_80"], NVCC_13_ARCHS | {70}, "12.8")
    assert cuda_arch.format_arch_list(archs) == "7.0;8.0+PTX"
    assert len(notes) == 1 and "sm_60" in notes[0] and "7.0" in notes[0]
    archs, notes = cuda_arch.default_archs(["sm_70", "sm_80"], NVCC_13_ARCHS, "13.0")
    assert cuda_arch.format_arch_list(archs) == "8.0+PTX"
    assert len(notes) == 1 and "sm_70" in notes[0] and "nvcc 13.0 cannot target it" in notes[0]
    # nvcc too old to list its targets: no filtering by nvcc; torch's compute_ entries are not binary targets.
    archs, _ = cuda_arch.default_archs(["sm_80", "sm_90a", "compute_90"], None, "10.2")
    assert cuda_arch.format_arch_list(archs) == "8.0;9.0+PTX"
    # A CPU torch names none: the documented fall-back list.
    archs, notes = cuda_arch.default_archs([], NVCC_13_ARCHS, "13.0")
    assert cuda_arch.format_arch_list(archs) == cuda_arch.FALLBACK_LIST and notes


def test_explicit_request_for_an_unsupported_arch_fails_by_name():
    with pytest.raises(ArchError, match=r"6\.1: the tensor-core kernels use fp16 WMMA, .* 7\.0"):
        cuda_arch.check_requested(cuda_arch.parse_arch_list("6.1;8.0"), NVCC_13_ARCHS, "13.0")
    with pytest.raises(ArchError, match=r"7\.0: nvcc 13\.0 cannot target it \(it targets 7\.5, "):  # Volta
        cuda_arch.check_requested([Arch(70)], NVCC_13_ARCHS, "13.0")
    cuda_arch.check_requested([Arch(70)], NVCC_13_ARCHS | {70}, "12.8")  # nvcc 12 still targets Volta
    cuda_arch.check_requested(cuda_arch.parse_arch_list("7.5;8.0"), NVCC_13_ARCHS, "13.0")  # Turing (T4)
    with pytest.raises(ArchError, match=r"13\.0: nvcc 13\.0 cannot target it"):
        cuda_arch.check_requested(cuda_arch.parse_arch_list("13.0"), NVCC_13_ARCHS, "13.0")
    cuda_arch.check_requested(cuda_arch.parse_arch_list("8.6;8.9+PTX"), NVCC_13_ARCHS, "13.0")
    cuda_arch.check_requested(cuda_arch.parse_arch_list("8.6"), None, "?")  # nvcc's list unknown: not checked


# --- versions -----------------------------------------------------------------------------------------------

def test_cuda_versions_are_read_from_nvcc_and_torch():
    nvcc = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
    assert cuda_toolkit.parse_release(nvcc) == (13, 0)
    assert cuda_toolkit.parse_release("12.8") == (12, 8)
    assert cuda_toolkit.parse_release("11.8.0") == (11, 8)
    assert cuda_toolkit.parse_release("no version here") is None


def test_major_mismatch_cannot_build_and_minor_mismatch_is_a_note():
    problem, note = cuda_toolkit.compare_versions((12, 4), (13, 0))
    assert note is None and "12.4" in problem and "13.0" in problem and "CUDA_HOME" in problem
    problem, note = cuda_toolkit.compare_versions((13, 1), (13, 0))
    assert problem is None and "13.1" in note
    assert cuda_toolkit.compare_versions((13, 0), (13, 0)) == (None, None)


# --- toolkit root -------------------------------------------------------------------------------------------

def _fake_toolkit(root: pathlib.Path) -> pathlib.Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "bin" / "nvcc").write_text("")
    (root / "include" / "cuda_runtime.h").write_text("")
    return root


@pytest.fixture
def no_default_root(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_toolkit, "DEFAULT_ROOT", str(tmp_path / "no-default-cuda"))


def test_wrapper_script_on_path_leads_to_the_toolkit_it_runs(tmp_path, no_default_root):
    toolkit = _fake_toolkit(tmp_path / "cuda-13.0")
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    assert cuda_toolkit.wrapper_targets(wrapper.read_text()) == [f"{toolkit}/bin/nvcc"]
    choice = cuda_toolkit.resolve_root({}, str(wrapper))
    assert choice.root == str(toolkit) and "wrapper" in choice.how


def test_symlinked_nvcc_leads_to_its_real_toolkit(tmp_path, no_default_root):
    toolkit = _fake_toolkit(tmp_path / "cuda-12.8")
    (tmp_path / "bin").mkdir()
    os.symlink(toolkit / "bin" / "nvcc", tmp_path / "bin" / "nvcc")
    assert cuda_toolkit.resolve_root({}, str(tmp_path / "bin" / "nvcc")).root == str(toolkit)


def test_cuda_home_wins_and_must_be_a_toolkit(tmp_path, no_default_root):
    toolkit = _fake_toolkit(tmp_path / "cuda")
    assert cuda_toolkit.resolve_root({"CUDA_HOME": str(toolkit)}, None).root == str(toolkit)
    choice = cuda_toolkit.resolve_root({"CUDA_HOME": str(tmp_path / "nowhere")}, str(toolkit / "bin" / "nvcc"))
    assert choice.root is None and "CUDA_HOME=" in choice.problem and "bin/nvcc" in choice.problem
    choice = cuda_toolkit.resolve_root({}, None)
    assert choice.root is None and "no nvcc on PATH" in choice.problem


# --- CUDA library headers -----------------------------------------------------------------------------------

def _headers(folder: pathlib.Path, *names):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("")
    return folder


def test_library_headers_come_from_torchs_wheels_only_when_the_toolkit_lacks_them(tmp_path):
    toolkit_include = _headers(tmp_path / "cuda" / "include", "cuda_runtime.h", "cublas_v2.h", "cublasLt.h")
    cu13 = _headers(tmp_path / "nvidia" / "cu13" / "include", "cublas_v2.h", "cusparse.h", "cusolverDn.h")
    dirs = cuda_toolkit.wheel_include_dirs([str(tmp_path / "nvidia")])
    assert dirs == [str(cu13)]
    search = cuda_toolkit.find_library_headers(str(toolkit_include), dirs)
    assert search.extra_dirs == [str(cu13)] and search.missing == []
    assert set(search.found_in) == {"cusparse.h", "cusolverDn.h"}  # cublas from the toolkit itself
    full = _headers(tmp_path / "full" / "include", *cuda_toolkit.LIBRARY_HEADERS)
    assert cuda_toolkit.find_library_headers(str(full), dirs).extra_dirs == []


def test_cuda12_wheels_have_one_include_folder_per_library(tmp_path):
    nvidia = tmp_path / "nvidia"
    sparse = _headers(nvidia / "cusparse" / "include", "cusparse.h")
    blas = _headers(nvidia / "cublas" / "include", "cublas_v2.h", "cublasLt.h")
    dirs = cuda_toolkit.wheel_include_dirs([str(nvidia)])
    assert set(dirs) == {str(sparse), str(blas)}
    search = cuda_toolkit.find_library_headers(str(tmp_path / "empty"), dirs)
    assert set(search.extra_dirs) == {str(sparse), str(blas)} and search.missing == ["cusolverDn.h"]


# --- the plan -----------------------------------------------------------------------------------------------

def _toolkit(release=(13, 0), missing=(), extra=("/wheels/nvidia/cu13/include",), cudart="/cuda/lib64"):
    headers = HeaderSearch(list(extra), list(missing), {h: extra[0] for h in ("cusparse.h",)} if extra else {})
    return Toolkit(RootChoice("/cuda", "from CUDA_HOME"), release, "%d.%d" % release, NVCC_13_ARCHS, headers, cudart)


def _plan(environ, torch=CUDA_TORCH, toolkit=None):
    return plan_build(environ, torch, lambda: toolkit or _toolkit())


def test_cuda_torch_with_a_matching_toolkit_builds_cuda_for_the_default_list():
    plan = _plan({})
    assert plan.variant == "cuda" and plan.cuda_reason is None
    assert layout.build_info(plan, CUDA_TORCH.version)["cuda_kernels"] is True
    assert cuda_arch.format_arch_list(plan.archs) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    assert plan.include_after == ("/wheels/nvidia/cu13/include",) and plan.nvcc == "/cuda/bin/nvcc"
    assert cuda_arch.format_arch_list(_plan({"TORCH_CUDA_ARCH_LIST": "8.6;8.9+PTX"}).archs) == "8.6;8.9+PTX"


def test_explicit_arch_that_cannot_be_built_is_an_error():
    with pytest.raises(BuildConfigError, match="7.0: nvcc 13.0 cannot target it"):
        _plan({"TORCH_CUDA_ARCH_LIST": "7.0;8.0"})
    with pytest.raises(BuildConfigError, match=r"6\.0;6\.1\+PTX: the tensor-core kernels use fp16 WMMA"):
        _plan({"TORCH_CUDA_ARCH_LIST": "Pascal;8.0"})
    with pytest.raises(BuildConfigError, match="native"):
        _plan({"TORCH_CUDA_ARCH_LIST": "native"})
    native = TorchInfo("2.14.1+cu130", "13.0", None, TORCH_ARCHS, visible=(90, 86, 90))
    assert cuda_arch.format_arch_list(_plan({"TORCH_CUDA_ARCH_LIST": "native"}, native).archs) == "8.6;9.0+PTX"


@pytest.mark.parametrize("environ, toolkit, reason", [
    ({"ATTN_EXT_SKIP_CUDA": "1"}, None, "ATTN_EXT_SKIP_CUDA=1"),
    ({}, _toolkit(release=(12, 4)), "nvcc is CUDA 12.4 but torch was built with CUDA 13.0"),
    ({}, _toolkit(missing=["cusparse.h"]), "cusparse.h"),
    ({}, Toolkit(RootChoice(None, "searched", "no CUDA toolkit found (no nvcc on PATH)")), "no CUDA toolkit found"),
])
def test_cuda_torch_falls_back_to_cpu_kernels_with_the_reason(environ, toolkit, reason):
    plan = _plan(environ, toolkit=toolkit)
    assert plan.variant == "cpu" and reason in plan.cuda_reason
    assert plan.unexpected == ("ATTN_EXT_SKIP_CUDA" not in environ)  # only an unrequested fall-back warns loudly
    info = layout.build_info(plan, CUDA_TORCH.version)
    assert info["cuda_kernels"] is False and reason in info["cuda_reason"] and info["cuda_archs"] == []
    if "ATTN_EXT_SKIP_CUDA" not in environ:
        with pytest.raises(BuildConfigError, match="ATTN_EXT_REQUIRE_CUDA=1"):
            _plan({**environ, "ATTN_EXT_REQUIRE_CUDA": "1"}, toolkit=toolkit)


def test_minor_version_difference_builds_with_a_note():
    plan = _plan({}, toolkit=_toolkit(release=(13, 1)))
    assert plan.variant == "cuda" and any("13.1" in note for note in plan.notes)


def test_compile_failure_falls_back_unless_cuda_is_required():
    plan = _plan({}).fallback("compiling the CUDA part failed (RuntimeError: boom)")
    assert plan.variant == "cpu" and plan.unexpected and "boom" in plan.cuda_reason
    with pytest.raises(BuildConfigError, match="ATTN_EXT_REQUIRE_CUDA=1.*boom"):
        _plan({"ATTN_EXT_REQUIRE_CUDA": "1"}).fallback("boom")


def test_cpu_torch_builds_cpu_kernels_without_looking_for_cuda():
    def no_probe():
        raise AssertionError("the toolkit is not looked up for a CPU torch")

    plan = plan_build({}, CPU_TORCH, no_probe)
    assert plan.variant == "cpu" and "CPU build" in plan.cuda_reason and not plan.unexpected
    with pytest.raises(BuildConfigError, match="ATTN_EXT_REQUIRE_CUDA=1 but torch 2.13.0"):
        plan_build({"ATTN_EXT_REQUIRE_CUDA": "1"}, CPU_TORCH, no_probe)
    with pytest.raises(BuildConfigError, match="contradicts"):
        plan_build({"ATTN_EXT_SKIP_CUDA": "1", "ATTN_EXT_REQUIRE_CUDA": "1"}, CUDA_TORCH, no_probe)


def test_force_cuda_with_a_cpu_torch_compiles_the_kernels_for_the_fallback_list():
    plan = _plan({"ATTN_EXT_FORCE_CUDA": "1"}, CPU_TORCH)
    assert plan.variant == "force_cuda" and cuda_arch.format_arch_list(plan.archs) == cuda_arch.FALLBACK_LIST
    info = layout.build_info(plan, CPU_TORCH.version)
    assert not info["cuda_kernels"] and "without their torch bindings" in info["cuda_reason"]
    assert info["cuda_archs"] == ["8.0", "9.0+PTX"]
    assert cuda_arch.format_arch_list(_plan({"ATTN_EXT_FORCE_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "8.9"},
                                            CPU_TORCH).archs) == "8.9"
    with pytest.raises(BuildConfigError, match="libcudart"):  # a check, so never a silent fall-back
        _plan({"ATTN_EXT_FORCE_CUDA": "1"}, CPU_TORCH, _toolkit(cudart=None))


# --- build folder and record --------------------------------------------------------------------------------

def test_build_folder_is_persistent_and_separate_per_torch_and_variant():
    cuda = layout.build_temp_dir("/src", "linux-x86_64", "cpython-311", "2.14.1+cu130", "cuda")
    assert cuda == "/src/build/temp.linux-x86_64-cpython-311-torch2.14.1+cu130-cuda"
    others = {layout.build_temp_dir("/src", "linux-x86_64", "cpython-311", "2.14.1+cu130", "cpu"),
              layout.build_temp_dir("/src", "linux-x86_64", "cpython-311", "2.13.0+cpu", "cpu")}
    assert cuda not in others and len(others) == 2


def test_ccache_note_says_whether_compiles_are_cached():
    assert "not installed" in layout.ccache_note(None, True, False)
    assert "torch runs the compilers through it" in layout.ccache_note("/usr/bin/ccache", True, False)
    assert "does not use it" in layout.ccache_note("/usr/bin/ccache", False, False)
    assert "TORCH_NO_COMPILER_WRAPPER" in layout.ccache_note("/usr/bin/ccache", True, True)


# --- the C++ runtime the extension links (build_support/cxx_runtime.py) ---------------------------------------

SYSTEM_CXX = shutil.which(os.environ.get("CXX") or "c++")
needs_cxx = pytest.mark.skipif(SYSTEM_CXX is None, reason="no C++ compiler on PATH to probe")


@needs_cxx
def test_probe_accepts_a_compiler_that_links_the_shared_runtime():
    ok, why = cxx_runtime.probe_compiler(SYSTEM_CXX)
    assert ok is True, why


@needs_cxx
def test_probe_rejects_a_compiler_that_embeds_the_runtime(tmp_path):
    # The wrapper of a GPU machine's image did this: every shared object got its own libstdc++.
    wrapper = tmp_path / "static-g++"
    wrapper.write_text(f'#!/bin/sh\nexec {SYSTEM_CXX} -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    ok, why = cxx_runtime.probe_compiler(str(wrapper))
    assert ok is False and "statically" in why and "libstdc++" in why


def test_probe_cannot_tell_without_a_compiler(tmp_path):
    ok, why = cxx_runtime.probe_compiler(str(tmp_path / "no-such-g++"))
    assert ok is None and "could not run" in why


def _fake_probe(verdicts):
    return lambda cxx: (verdicts[cxx], "" if verdicts[cxx] else f"{cxx} embeds the runtime")


def test_a_compiler_that_embeds_the_runtime_is_replaced_by_one_that_does_not():
    probe = _fake_probe({"/opt/gcc/bin/g++": False, "/usr/bin/g++": True})
    chosen, notes, error = cxx_runtime.choose_compiler({"CXX": "/opt/gcc/bin/g++"}, probe,
                                                       lambda: ["/opt/gcc/bin/g++", "/usr/bin/g++"])
    assert error is None and chosen["CXX"] == "/usr/bin/g++"
    assert "/opt/gcc/bin/g++ embeds the runtime" in notes[0] and "/usr/bin/g++ instead" in notes[0]


def test_no_usable_compiler_is_an_error_that_says_what_to_set():
    probe = _fake_probe({"/opt/gcc/bin/g++": False, "/other/g++": False})
    chosen, _, error = cxx_runtime.choose_compiler({"CXX": "/opt/gcc/bin/g++"}, probe, lambda: ["/other/g++"])
    assert chosen == {} and "set CXX" in error


def test_a_good_or_unknown_compiler_is_kept():
    for verdict in (True, None):
        chosen, _, error = cxx_runtime.choose_compiler({}, lambda cxx: (verdict, "?"), lambda: ["/usr/bin/g++"])
        assert chosen == {} and error is None


def test_the_built_extension_links_the_shared_runtime():
    import attn_ext

    library = attn_ext._C.__file__ if hasattr(attn_ext, "_C") else None
    if library is None or not library.endswith(".so"):
        pytest.skip("attn_ext._C is not a compiled ELF extension in this install")
    assert cxx_runtime.links_shared_runtime(cxx_runtime.needed_libraries(library))
    assert cxx_runtime.check_built_extension(library) is None
