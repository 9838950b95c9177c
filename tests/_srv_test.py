from hypothesis import given, settings, HealthCheck, Phase
import test_hostile_workflows as T
from test_hostile_workflows import fake_comfy  # noqa
from hypothesis import strategies as st
@settings(max_examples=400, deadline=None, database=None, derandomize=False, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@given(image=st.one_of(T.input_values, st.sampled_from(["mine.png", "../secret.png", "mine.png\x00"])))
def test_srv(image, fake_comfy, tmp_path_factory):
    w = {"1": {"class_type": "LoadImage", "inputs": {"image": image}}, "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}}}
    T.test_run_workflow_on_a_server_sends_a_prompt_or_one_error_line.hypothesis.inner_test(w, fake_comfy, tmp_path_factory)
