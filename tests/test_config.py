import pytest

from rlxrt import Config, ConfigError, load_config


def write(tmp_path, text):
    p = tmp_path / "rlxrt.toml"
    p.write_text(text)
    return p


def test_defaults(tmp_path):
    c = load_config(env={}, cwd=tmp_path)
    assert c.providers == ("cpu",)
    assert c.strict is False and c.graph_optimization == "all" and c.cache is True
    assert c.spinning is False  # threads 0 (ORT picks, usually > 1): sessions that may run side by side


def test_spinning_follows_threads_and_never_outlives_a_run():
    import onnxruntime as ort

    from rlxrt.backends import session_options

    assert Config(intra_op_threads=1).spinning is True
    assert Config(intra_op_threads=4).spinning is False
    assert Config(intra_op_threads=4, allow_spinning=True).spinning is True
    assert Config(intra_op_threads=1, allow_spinning=False).spinning is False
    for config, spin in ((Config(intra_op_threads=2, allow_spinning=True), "1"), (Config(intra_op_threads=2), "0")):
        opts = session_options(ort, config)
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == spin
        assert opts.get_session_config_entry("session.force_spinning_stop") == "1"


def test_a_batchs_steps_spin_unless_told_not_to():
    from rlxrt.app.reference import reference_pair
    from rlxrt.sessions.batch import Batch, steps_config

    assert steps_config(Config(intra_op_threads=2)).spinning is True
    assert steps_config(Config(intra_op_threads=2, allow_spinning=False)).spinning is False
    assert steps_config(None).allow_spinning is not None
    for allow, spin in ((None, "1"), (False, "0")):
        config = Config(providers=("cpu",), intra_op_threads=2, allow_spinning=allow, cache=False)
        opts = Batch(reference_pair()[0], config, slots=2, calibrate=False).graph.session.get_session_options()
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == spin


def test_precedence_args_over_env_over_file_over_defaults(tmp_path):
    f = write(tmp_path, 'providers = ["cuda", "cpu"]\nintra_op_threads = 3\ninter_op_threads = 2\nstrict = true\n')
    env = {"RLXRT_INTRA_OP_THREADS": "5", "RLXRT_GRAPH_OPTIMIZATION": "basic"}
    c = load_config(f, env=env, intra_op_threads=7)
    assert c.intra_op_threads == 7          # argument wins
    assert c.graph_optimization == "basic"  # env over default
    assert c.inter_op_threads == 2          # file over default
    assert c.providers == ("cuda", "cpu") and c.strict is True
    c2 = load_config(f, env=env)
    assert c2.intra_op_threads == 5         # env over file


def test_file_found_in_cwd_and_via_env(tmp_path):
    write(tmp_path, 'providers = ["cpu"]\nintra_op_threads = 2\n')
    assert load_config(env={}, cwd=tmp_path).intra_op_threads == 2
    other = tmp_path / "other.toml"
    other.write_text("intra_op_threads = 9\n")
    assert load_config(env={"RLXRT_CONFIG": str(other)}, cwd=tmp_path).intra_op_threads == 9


def test_none_arguments_are_ignored(tmp_path):
    c = load_config(env={"RLXRT_PROVIDERS": "cuda,cpu"}, cwd=tmp_path, providers=None)
    assert c.providers == ("cuda", "cpu")


def test_provider_options(tmp_path):
    f = write(tmp_path, '[provider_options.cuda]\ndevice_id = 1\nenable_cuda_graph = true\n')
    c = load_config(f, env={})
    assert dict(c.provider_options["cuda"]) == {"device_id": "1", "enable_cuda_graph": "1"}
    c = load_config(env={"RLXRT_PROVIDER_OPTIONS": '{"cuda": {"device_id": 2}}'}, cwd=tmp_path)
    assert c.provider_options["cuda"]["device_id"] == "2"


@pytest.mark.parametrize("kwargs, words", [
    ({"providers": ["gpu"]}, ["'gpu'", "known providers", "cuda"]),
    ({"providers": []}, ["providers", "non-empty"]),
    ({"providers": ["cpu", "cpu"]}, ["twice"]),
    ({"strict": "maybe"}, ["strict", "'maybe'", "true or false"]),
    ({"intra_op_threads": -1}, ["intra_op_threads", "-1", "0..256"]),
        ({"intra_op_threads": 10**6}, ["intra_op_threads", "1000000", "0..256"]),
    ({"intra_op_threads": "two"}, ["intra_op_threads", "'two'"]),
    ({"inter_op_threads": 1.5}, ["inter_op_threads", "1.5"]),
    ({"graph_optimization": "max"}, ["graph_optimization", "'max'", "disable, basic, extended, layout, all"]),
    ({"provider_options": {"gpu": {}}}, ["'gpu'", "provider_options"]),
    ({"provider_options": {"cuda": {"x": [1]}}}, ["provider_options.cuda.x"]),
    ({"provider_options": "{not json"}, ["provider_options", "JSON"]),
    ({"cache_dir": ""}, ["cache_dir"]),
    ({"colour": "blue"}, ["'colour'", "allowed keys", "providers"]),
])
def test_bad_arguments(tmp_path, kwargs, words):
    with pytest.raises(ConfigError) as info:
        load_config(env={}, cwd=tmp_path, **kwargs)
    for w in words:
        assert w in str(info.value)


def test_bad_file(tmp_path):
    f = write(tmp_path, 'colour = "blue"\n')
    with pytest.raises(ConfigError, match=r"unknown config key 'colour' \(from file"):
        load_config(f, env={})
    f = write(tmp_path, 'providers = [\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="config file .* does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    f = write(tmp_path, 'intra_op_threads = "lots"\n')
    with pytest.raises(ConfigError, match="intra_op_threads.*from file.*'lots'"):
        load_config(f, env={})


def test_bad_env(tmp_path):
    with pytest.raises(ConfigError, match="RLXRT_PROVIDRS.*allowed: RLXRT_PROVIDERS.*RLXRT_SMOLLM2_DIR"):
        load_config(env={"RLXRT_PROVIDRS": "cpu"}, cwd=tmp_path)
    # where the SmolLM2 recipe builds is not a config field, and no command refuses it
    assert load_config(env={"RLXRT_SMOLLM2_DIR": str(tmp_path)}, cwd=tmp_path).intra_op_threads == 0
    with pytest.raises(ConfigError, match="environment RLXRT_STRICT"):
        load_config(env={"RLXRT_STRICT": "perhaps"}, cwd=tmp_path)


def test_frozen_and_overrides():
    c = Config()
    with pytest.raises(Exception):
        c.strict = True  # type: ignore[misc]
    c2 = c.with_overrides(strict=True, providers="cuda,cpu", intra_op_threads=None)
    assert c2.strict and c2.providers == ("cuda", "cpu") and c.strict is False
    with pytest.raises(ConfigError):
        c.with_overrides(nonsense=1)


def test_defaults_are_the_lowest_precedence(tmp_path):
    """What demo and bench use for their 1-thread default: the environment and the file still win."""
    assert load_config(env={}, cwd=tmp_path, defaults={"intra_op_threads": 1}).intra_op_threads == 1
    env = {"RLXRT_INTRA_OP_THREADS": "2"}
    assert load_config(env=env, cwd=tmp_path, defaults={"intra_op_threads": 1}).intra_op_threads == 2
    (tmp_path / "rlxrt.toml").write_text("intra_op_threads = 3\n")
    assert load_config(env={}, cwd=tmp_path, defaults={"intra_op_threads": 1}).intra_op_threads == 3
    assert load_config(env={}, cwd=tmp_path, defaults={"intra_op_threads": 1}, intra_op_threads=4).intra_op_threads == 4
