"""serve_smoke's ``refusals``: refused requests beside a plain one against a stub OpenAI server (the client logic; the
real server's answers are checked on the GPU machine by bench/experiments/device/serve_refusal.sh)."""
from __future__ import annotations

import http.server
import json
import threading

import pytest

from blockdiff.bench.experiments import serve_smoke


def _stub(answer):
    """An HTTP server on a free port answering each POST with ``answer(body) -> (status, json)``."""
    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, out = answer(body)
            raw = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _refused(body):
    return (body.get("top_k") is not None or body.get("logprobs") is not None or body.get("temperature") == 0.5
            or "not_a_blockdiff_key" in body["vllm_xargs"])


def _served(text="ok"):
    return 200, {"choices": [{"text": text, "finish_reason": "length"}]}


@pytest.mark.parametrize("how", ["http_400", "finish_reason_error", "vllm_0_26"])
def test_refusals_ok_when_each_refused_request_fails_and_the_plain_one_is_served(tmp_path, how):
    def answer(body):
        if not _refused(body):
            return _served()
        if how == "http_400":  # vLLM 0.33.0: RequestError(validation_error) -> VLLMValidationError -> 400
            return 400, {"error": {"message": "top_k=5 is not supported", "type": "BadRequestError", "code": 400}}
        if how == "vllm_0_26":  # as measured on the H200: 500 unstreamed, an empty stream streamed
            if body.get("stream"):
                return 200, "data: [DONE]\n\n"
            return 500, {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
        return 200, {"choices": [{"text": "", "finish_reason": "error"}]}  # finish reason only (LLMEngine's way)

    srv = _stub(answer)
    try:
        out = tmp_path / "r.json"
        url = f"http://127.0.0.1:{srv.server_port}"
        assert serve_smoke.main(["refusals", "--base-url", url, "--model", "m", "--out", str(out)]) == 0
        rec = json.loads(out.read_text())
        assert rec["ok"] and set(rec["rows"]) == {"plain", *serve_smoke.REFUSED}
        assert not rec["rows"]["plain"]["failed"] and all(rec["rows"][n]["failed"] for n in serve_smoke.REFUSED)
        if how == "http_400":
            assert rec["rows"]["top_k"]["status"] == 400 and "top_k" in rec["rows"]["top_k"]["error"]
    finally:
        srv.shutdown()


@pytest.mark.parametrize("bad", ["a_refused_one_served", "the_plain_one_failed", "the_plain_one_empty"])
def test_refusals_not_ok_when_a_refused_request_is_served_or_the_plain_one_is_not(tmp_path, bad):
    def answer(body):
        if "top_k" in body and bad == "a_refused_one_served":
            return _served()
        if _refused(body):
            return 400, {"error": {"message": "refused"}}
        if bad == "the_plain_one_failed":
            return 500, {"error": {"message": "boom"}}
        return _served("" if bad == "the_plain_one_empty" else "ok")

    srv = _stub(answer)
    try:
        out = tmp_path / "r.json"
        url = f"http://127.0.0.1:{srv.server_port}"
        assert serve_smoke.main(["refusals", "--base-url", url, "--model", "m", "--out", str(out)]) == 1
        assert not json.loads(out.read_text())["ok"]
    finally:
        srv.shutdown()


def test_classify_refusal_counts_an_http_error_or_finish_reason_error_as_failed():
    assert serve_smoke.classify_refusal(200, {"choices": [{"text": "x", "finish_reason": "stop"}]})["failed"] is False
    assert serve_smoke.classify_refusal(500, "Internal Server Error")["failed"] is True
    assert serve_smoke.classify_refusal(200, {"choices": [{"finish_reason": "error"}]})["failed"] is True


def test_classify_refusal_reads_a_streamed_answer_s_error_event_or_finish_reason():
    """A streamed request's HTTP status is 200 before it fails (vLLM 0.33.0 sends an error event in the stream)."""
    ev = 'data: {"error": {"message": "top_k=5 is not supported", "code": 400}}\n\ndata: [DONE]\n'
    row = serve_smoke.classify_refusal(200, ev)
    assert row["failed"] and row["error"] == "top_k=5 is not supported"
    fin = 'data: {"choices": [{"text": "", "finish_reason": "error"}]}\n\ndata: [DONE]\n'
    assert serve_smoke.classify_refusal(200, fin)["failed"]
    ok = ('data: {"choices": [{"text": "ab", "finish_reason": null}]}\n\n'
          'data: {"choices": [{"text": "c", "finish_reason": "length"}]}\n\ndata: [DONE]\n')
    row = serve_smoke.classify_refusal(200, ok)
    assert not row["failed"] and row["finish_reason"] == "length" and row["error"] is None


def test_a_stream_that_ends_without_a_finish_reason_counts_as_failed():
    """vLLM 0.26.0 (H200, 2026-12-07, serve_refusal.sh): a streamed request the plugin refused at add_request got
    HTTP 200 and only "data: [DONE]"; the client was told nothing and the check had counted it as served."""
    row = serve_smoke.classify_refusal(200, "data: [DONE]\n\n")
    assert row["failed"] and row["error"] == serve_smoke.STREAM_WITHOUT_END
    cut = 'data: {"choices": [{"text": "ab", "finish_reason": null}]}\n\ndata: [DONE]\n'
    assert serve_smoke.classify_refusal(200, cut)["failed"]


def test_a_streamed_answer_with_no_event_at_all_counts_as_failed():
    """An HTTP 200 stream with an empty body, or text that holds no event, ended no request either: it was counted
    as served (its text became the error, so the no-finish-reason rule, which asked for no error, was skipped)."""
    for body in ("", "\n", "upstream closed"):
        row = serve_smoke.classify_refusal(200, body)
        assert row["failed"] and row["finish_reason"] is None, (body, row)
        assert row["error"] == (body or serve_smoke.STREAM_WITHOUT_END), (body, row)
    ok = 'data: {"choices": [{"text": "c", "finish_reason": "stop"}]}\n\ndata: [DONE]\n'
    assert not serve_smoke.classify_refusal(200, ok)["failed"]
