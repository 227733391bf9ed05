import logging

import pytest

from fake_ort import FakeOrt
from rlxrt import Config, ProviderError
from rlxrt.backends import Registry

CPU, CUDA, COREML = "CPUExecutionProvider", "CUDAExecutionProvider", "CoreMLExecutionProvider"


def test_real_cpu_probe_runs():
    st = Registry().status("cpu")
    assert st.available and st.reason == ""


def test_available_provider():
    reg = Registry(FakeOrt([CUDA, CPU], works=[CUDA, CPU]), platform="linux")
    assert reg.status("cuda").available
    res = reg.resolve(Config(providers=("cuda", "cpu")))
    assert res.names == ["cuda", "cpu"] and res.fallbacks == []
    assert res.providers[0] == (CUDA, {})  # ORT's default device; a device_id makes ORT >= 1.26 warn at every session


def test_provider_options_reach_ort():
    reg = Registry(FakeOrt([CUDA, CPU], works=[CUDA, CPU]), platform="linux")
    res = reg.resolve(Config(providers=("cuda",), provider_options={"cuda": {"device_id": 3}}))
    assert res.providers == [(CUDA, {"device_id": "3"})]


def test_missing_package(monkeypatch):
    reg = Registry(platform="linux")
    reg._ort_error = "onnxruntime is not installed; pip install 'rlxrt[cpu]'"
    st = reg.status("cpu")
    assert not st.available and "rlxrt[cpu]" in st.reason
    with pytest.raises(ProviderError, match="rlxrt\\[cpu\\]"):
        reg.resolve(Config(providers=("cpu",)))


def test_not_in_build_names_the_install():
    reg = Registry(FakeOrt([CPU], works=[CPU]), platform="linux")
    st = reg.status("cuda")
    assert not st.available and "not in this onnxruntime build" in st.reason and "rlxrt[cuda]" in st.reason


def test_wrong_platform():
    reg = Registry(FakeOrt([COREML, CPU], works=[COREML, CPU]), platform="linux")
    st = reg.status("coreml")
    assert not st.available and "darwin" in st.reason and "linux" in st.reason


def test_silent_fallback_is_detected():
    # onnxruntime-gpu on a machine without CUDA libraries: listed, but sessions run on CPU
    reg = Registry(FakeOrt([CUDA, CPU], works=[CPU]), platform="linux")
    st = reg.status("cuda")
    assert not st.available and "silently ran on CPUExecutionProvider" in st.reason and "CUDA" in st.reason


def test_session_creation_error_is_a_reason():
    reg = Registry(FakeOrt([CUDA, CPU], works=[CPU], raises=[CUDA]), platform="linux")
    st = reg.status("cuda")
    assert not st.available and "libfoo.so" in st.reason


def test_non_strict_fallback_warns_and_records(caplog):
    reg = Registry(FakeOrt([CUDA, CPU], works=[CPU]), platform="linux")
    with caplog.at_level(logging.WARNING, logger="rlxrt"):
        res = reg.resolve(Config(providers=("cuda", "cpu")))
    assert res.names == ["cpu"]
    assert len(res.fallbacks) == 1 and "'cuda'" in res.fallbacks[0]
    assert any("cuda" in r.message for r in caplog.records)


def test_non_strict_with_nothing_available_uses_cpu():
    reg = Registry(FakeOrt([CPU], works=[CPU]), platform="linux")
    res = reg.resolve(Config(providers=("cuda",)))
    assert res.names == ["cpu"] and any("using cpu" in f for f in res.fallbacks)


def test_strict_fallback_is_an_error():
    reg = Registry(FakeOrt([CUDA, CPU], works=[CPU]), platform="linux")
    with pytest.raises(ProviderError, match="'cuda' is unavailable.*strict"):
        reg.resolve(Config(providers=("cuda", "cpu"), strict=True))


def test_unknown_provider_name():
    with pytest.raises(ProviderError, match="unknown provider 'gpu'"):
        Registry(FakeOrt([CPU], works=[CPU])).status("gpu")


def test_probe_runs_once_per_provider():
    ort = FakeOrt([CPU], works=[CPU])
    calls = []
    orig = ort.InferenceSession

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    ort.InferenceSession = counting
    reg = Registry(ort, platform="linux")
    reg.status("cpu"), reg.status("cpu")
    assert len(calls) == 1
