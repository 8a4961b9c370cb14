"""Request metadata and policy rejections through `paged serve`, with the official `openai`
client: the `user` field / X-Paged-Tenant header and the `deadline_s` extra field are accepted
(a bad deadline is a 400 naming it), and a request the `slo` policy cannot serve in time comes
back as HTTP 503 in the OpenAI error shape with the policy's reason."""

import pytest

from helpers.server import API_KEY, free_port, serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slo_server(default_model_dir, tmp_path_factory):
    port = free_port()
    tmp = tmp_path_factory.mktemp("slo-server")
    # Assume 0.5 s a step until steps are seen: 8 tokens need ~4 s.
    args = ["--model", default_model_dir, "--device", "cpu", "--attention", "torch", "--host", "127.0.0.1",
            "--port", str(port), "--api-key", API_KEY, "--num-kv-blocks", "128", "--max-model-len", "256",
            "--max-num-seqs", "8", "-q", "--policy", "slo", "--policy-option", "initial_step_time_s=0.5",
            "--policy-option", "smoothing=0.01"]
    with serve(args, tmp, port) as s:
        yield s


def test_deadline_rejection_and_metadata_through_the_openai_client(slo_server):
    import openai

    client = openai.OpenAI(base_url=slo_server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=model, prompt="Hello", max_tokens=8, extra_body={"deadline_s": 1.0, "ignore_eos": True})
    assert e.value.status_code == 503
    error = e.value.body if isinstance(e.value.body, dict) and "message" in e.value.body else e.value.body["error"]
    assert "cannot meet its deadline" in error["message"] and error["code"] == "rejected_by_policy"

    with pytest.raises(openai.BadRequestError, match="deadline_s: invalid value -2"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"deadline_s": -2})

    # A deadline it can meet, with a tenant: served.
    out = client.completions.create(model=model, prompt="Hello", max_tokens=2, user="tenant-a",
                                    extra_body={"deadline_s": 120.0, "ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
    # The tenant may come as a header too.
    out = client.with_options(default_headers={"X-Paged-Tenant": "tenant-b"}).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].message.content is not None
