"""Request metadata and policy rejections through `paged serve`, with the official `openai`
client: the tenant (the `user` field, or the X-Paged-Tenant header) reaches the policy's view of
the request, the `deadline_s` extra field is accepted (a bad deadline is a 400 naming it), and a
request the `slo` policy cannot serve in time comes back as HTTP 503 in the OpenAI error shape
with the policy's reason.

The server runs ``slo-seen``, a policy plugin installed for this module only: the bundled `slo`
policy, which also writes each admission it is asked for (the request's id and tenant, as its
``RequestView`` shows them) to a JSON-lines file the test reads."""

import json

import pytest

from helpers.server import API_KEY, free_port, serve

pytestmark = pytest.mark.slow

PLUGIN = '''
import json

from pydantic import Field

from paged.core.hookspecs import PolicySpec, hookimpl
from paged.plugins.slo import SLOOptions, SLOPolicy


class SeenOptions(SLOOptions):
    seen_path: str = Field(description="JSON-lines file: one line per admission the policy is asked for")


class SeenPolicy(SLOPolicy):
    name = "slo-seen"

    def admit(self, request, now):
        with open(self.options.seen_path, "a") as f:
            f.write(json.dumps({"request_id": request.request_id, "tenant": request.tenant}) + "\\n")
        return super().admit(request, now)


@hookimpl
def register_policies():
    return [PolicySpec("slo-seen", SeenPolicy, SeenOptions, "slo, recording what each admission sees")]
'''


def install_plugin(site) -> None:
    """The plugin as an installed distribution: its module and a dist-info with its entry point."""
    (site / "paged_slo_seen.py").write_text(PLUGIN)
    dist_info = site / "paged_slo_seen-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: paged-slo-seen\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[paged]\nslo_seen = paged_slo_seen\n")


class Seen:
    """The admissions the policy has written, read a call at a time."""

    def __init__(self, path) -> None:
        self.path, self.read = path, 0

    def since_last(self) -> list[dict]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        new, self.read = lines[self.read:], len(lines)
        return [json.loads(line) for line in new]


@pytest.fixture(scope="module")
def slo_server(default_model_dir, tmp_path_factory):
    port = free_port()
    tmp = tmp_path_factory.mktemp("slo-server")
    site = tmp / "site"
    site.mkdir()
    install_plugin(site)
    seen_path = tmp / "seen.jsonl"
    # Assume 0.5 s a step until steps are seen: 8 tokens need ~4 s.
    args = ["--model", default_model_dir, "--device", "cpu", "--attention", "torch", "--host", "127.0.0.1",
            "--port", str(port), "--api-key", API_KEY, "--num-kv-blocks", "128", "--max-model-len", "256",
            "--max-num-seqs", "8", "-q", "--policy", "slo-seen", "--policy-option", "initial_step_time_s=0.5",
            "--policy-option", "smoothing=0.01", "--policy-option", f"seen_path={seen_path}"]
    with serve(args, tmp, port, env={"PYTHONPATH": str(site)}) as s:
        s.seen = Seen(seen_path)
        yield s


def test_deadline_rejection_and_metadata_through_the_openai_client(slo_server):
    import openai

    client = openai.OpenAI(base_url=slo_server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    seen = slo_server.seen
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=model, prompt="Hello", max_tokens=8, extra_body={"deadline_s": 1.0, "ignore_eos": True})
    assert e.value.status_code == 503
    error = e.value.body if isinstance(e.value.body, dict) and "message" in e.value.body else e.value.body["error"]
    assert "cannot meet its deadline" in error["message"] and error["code"] == "rejected_by_policy"
    assert [s["tenant"] for s in seen.since_last()] == [None]  # asked once, at arrival; no tenant sent

    with pytest.raises(openai.BadRequestError, match="deadline_s: invalid value -2"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"deadline_s": -2})
    assert seen.since_last() == []  # refused before it reached the engine

    # A deadline it can meet, with a tenant: served, and the policy saw the tenant.
    out = client.completions.create(model=model, prompt="Hello", max_tokens=2, user="tenant-a",
                                    extra_body={"deadline_s": 120.0, "ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
    admissions = seen.since_last()
    assert admissions and {s["tenant"] for s in admissions} == {"tenant-a"}
    # The tenant may come as a header too.
    out = client.with_options(default_headers={"X-Paged-Tenant": "tenant-b"}).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].message.content is not None
    admissions = seen.since_last()
    assert admissions and {s["tenant"] for s in admissions} == {"tenant-b"}
    # The body's `user` wins over the header.
    client.with_options(default_headers={"X-Paged-Tenant": "tenant-b"}).completions.create(
        model=model, prompt="Hello", max_tokens=1, user="tenant-c")
    assert {s["tenant"] for s in seen.since_last()} == {"tenant-c"}
