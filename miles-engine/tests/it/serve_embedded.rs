//! The SGLang-protocol server over the embedded burn engine and real tiny HF checkpoints
//! (`fixtures/`): log-probs and routed experts on the wire against HF transformers' reference
//! outputs, chat completions with the checkpoint's chat template, weight updates from disk,
//! aborts, and miles-session's SGLang client and session server on top.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use miles_core::{
    FinishReason, GenerateRequest, InferenceEngine, MemoryTag, NamedTensors, Sample, SampleStatus,
    SamplingParams, TokenId, WeightVersion,
};
use miles_engine::serve::{ServeOptions, server_info};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_session::sglang::sglang_router;
use miles_session::sglang::{SglangConfig, SglangEngine};
use miles_tito::ChatTokenizer;
use serde_json::{Value, json};

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(path)
}

/// Serves `dir` with the embedded engine on loopback, as `miles serve` would.
async fn serve(dir: &Path) -> String {
    let args = ServeOptions {
        weights_root: Some(fixture("models")),
        ..ServeOptions::new(dir)
    };
    let info = server_info(&args).unwrap();
    let engine = EmbeddedEngine::from_pretrained(
        dir,
        &burn::tensor::Device::flex(),
        EngineConfig::default(),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = sglang_router(Arc::new(engine), info);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn http() -> HttpClient {
    HttpClient::new(Duration::from_secs(120))
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = http()
        .post_json(&format!("{base}{path}"), body, &[])
        .await
        .unwrap();
    let value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    (r.status.as_u16(), value)
}

fn reference(model: &str) -> (Vec<Vec<TokenId>>, NamedTensors) {
    let inputs: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(&format!("models/{model}/reference_inputs.json")))
            .unwrap(),
    )
    .unwrap();
    let ids = serde_json::from_value(inputs["input_ids"].clone()).unwrap();
    let bytes = std::fs::read(fixture(&format!(
        "models/{model}/reference_outputs.safetensors"
    )))
    .unwrap();
    (ids, NamedTensors::from_safetensors_bytes(&bytes).unwrap())
}

/// HF's next-token distribution after the whole reference sequence `seq`: (argmax, its
/// log-softmax), from the transformers logits.
fn hf_greedy_next(outputs: &NamedTensors, seq: usize) -> (TokenId, f64) {
    let logits = outputs.get("logits").unwrap();
    let [_, len, vocab] = logits.shape().try_into().unwrap();
    let all = logits.to_f32().unwrap();
    let row: Vec<f64> = all[(seq * len + len - 1) * vocab..(seq * len + len) * vocab]
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    let max = row.iter().copied().fold(f64::MIN, f64::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let arg = row
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0;
    (arg as TokenId, row[arg] - lse)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dense_logprobs_on_the_wire_match_transformers() {
    let base = serve(&fixture("serve/qwen3-tiny-chat")).await;
    let (inputs, outputs) = reference("qwen3-tiny");
    for (seq, prompt) in inputs.iter().enumerate() {
        let (status, body) = post(
            &base,
            "/generate",
            &json!({"input_ids": prompt, "return_logprob": true,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 1}}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let (hf_id, hf_lp) = hf_greedy_next(&outputs, seq);
        let entry = &body["meta_info"]["output_token_logprobs"][0];
        assert_eq!(entry[1], json!(hf_id), "greedy token of sequence {seq}");
        let lp = entry[0].as_f64().unwrap();
        assert!((lp - hf_lp).abs() < 1e-4, "{lp} vs transformers {hf_lp}");
        assert!(entry[2].is_null());
        assert_eq!(
            body["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 1})
        );
        assert_eq!(body["meta_info"]["prompt_tokens"], json!(prompt.len()));
        assert_eq!(body["meta_info"]["weight_version"], json!("0"));
    }
    // The same through miles-session's client.
    let client = SglangEngine::new(SglangConfig::new(&base));
    let output = client
        .generate(GenerateRequest::new(
            inputs[0].clone(),
            SamplingParams {
                temperature: 0.0,
                max_new_tokens: Some(1),
                ..SamplingParams::default()
            },
        ))
        .await
        .unwrap();
    let (hf_id, hf_lp) = hf_greedy_next(&outputs, 0);
    assert_eq!(output.output_ids, [hf_id]);
    assert!((output.output_log_probs[0] - hf_lp).abs() < 1e-4);
    assert_eq!(output.finish_reason, FinishReason::Length);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moe_routed_experts_on_the_wire_match_transformers() {
    let dir = fixture("models/glm4moe-tiny");
    let base = serve(&dir).await;
    let (inputs, outputs) = reference("glm4moe-tiny");
    let mut config = SglangConfig::new(&base);
    config.num_layers = Some(3);
    let client = SglangEngine::new(config);
    let prompt = inputs[1].clone();
    let mut request = GenerateRequest::new(
        prompt.clone(),
        SamplingParams {
            temperature: 0.0,
            max_new_tokens: Some(3),
            ..SamplingParams::default()
        },
    );
    request.return_routed_experts = true;
    let output = client.generate(request).await.unwrap();
    let (hf_id, hf_lp) = hf_greedy_next(&outputs, 1);
    assert_eq!(output.output_ids[0], hf_id);
    assert!((output.output_log_probs[0] - hf_lp).abs() < 1e-4);
    let routed = output.routed_experts.unwrap();
    // SGLang's routed-experts layout: prompt + output − 1 rows, every layer, top-k 2.
    assert_eq!(routed.shape(), [prompt.len() + 3 - 1, 3, 2]);
    for layer in [1, 2] {
        let reference = outputs
            .get(&format!("layer{layer}.topk_indices_sorted"))
            .unwrap();
        let reference: Vec<i64> = reference
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        for row in 0..prompt.len() {
            let ours = &routed.as_slice()[(row * 3 + layer) * 2..(row * 3 + layer) * 2 + 2];
            let mut ours: Vec<i64> = ours.iter().map(|&e| i64::from(e)).collect();
            ours.sort_unstable();
            // Sequence 1's rows follow sequence 0's 12 rows in the flattened reference.
            let hf = &reference[(12 + row) * 2..(12 + row) * 2 + 2];
            assert_eq!(ours, hf, "layer {layer} row {row}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_weights_abort_and_sessions_on_the_embedded_engine() {
    let dir = fixture("serve/qwen3-tiny-chat");
    let base = serve(&dir).await;
    let client = http();
    assert_eq!(
        client
            .get(&format!("{base}/health_generate"))
            .await
            .unwrap()
            .status,
        200
    );

    // Chat: the prompt is the Qwen3 template's rendering of the messages.
    let tito = miles_tito::TitoChat::load(&dir, "qwen3").unwrap();
    let messages = [miles_core::Message::user("Say hi.")];
    let rendered = tito
        .render(&messages, &[], true, &tito.forced_kwargs())
        .unwrap();
    let (status, body) = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 6, "temperature": 0,
                "return_meta_info": true, "logprobs": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], json!(rendered.len()));
    let choice = &body["choices"][0];
    assert!(choice["message"]["content"].is_string());
    let meta = &choice["meta_info"];
    let ids: Vec<TokenId> = meta["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[1].as_u64().unwrap() as TokenId)
        .collect();
    assert_eq!(
        ids.len(),
        meta["completion_tokens"].as_u64().unwrap() as usize
    );
    assert_eq!(
        choice["logprobs"]["content"].as_array().unwrap().len(),
        ids.len()
    );
    // Greedy is greedy: /generate on the rendered ids gives the same tokens.
    let (_, generated) = post(
        &base,
        "/generate",
        &json!({"input_ids": rendered, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                "stop_token_ids": tito.stop_token_ids()}}),
    )
    .await;
    assert_eq!(generated["output_ids"], json!(ids));

    // Weight update from an HF directory, with a version.
    let (status, body) = post(
        &base,
        "/update_weights_from_disk",
        &json!({"model_path": fixture("models/qwen3-tiny"), "weight_version": "5"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["success"], json!(true));
    let version: Value = client
        .get(&format!("{base}/get_weight_version"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(version["weight_version"], "5");
    let (_, body) = post(&base, "/generate", &json!({"input_ids": [1, 2, 3]})).await;
    assert_eq!(body["meta_info"]["weight_version"], "5");
    let (status, body) = post(
        &base,
        "/update_weights_from_disk",
        &json!({"model_path": "/nonexistent/ckpt", "weight_version": "6"}),
    )
    .await;
    assert_eq!(status, 403, "outside --weights-root: {body}");
    assert_eq!(body["success"], json!(false));
    let (status, body) = post(
        &base,
        "/update_weights_from_disk",
        &json!({"model_path": fixture("models/no-such-checkpoint"), "weight_version": "6"}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["success"], json!(false));

    // Abort by request id: the long generation ends with finish reason abort. A tiny model
    // may finish its 240 tokens before an abort reaches it (an abort for an id not yet, or no
    // longer, running is a no-op, as in SGLang): such an attempt must have run to its length,
    // and the next one is tried under a new id.
    let mut aborted = None;
    for attempt in 0..50 {
        let rid = format!("long-{attempt}");
        let long = {
            let (base, rid) = (base.clone(), rid.clone());
            tokio::spawn(async move {
                post(
                    &base,
                    "/generate",
                    &json!({"input_ids": [5, 6, 7], "rid": rid,
                            "sampling_params": {"max_new_tokens": 240}}),
                )
                .await
            })
        };
        while !long.is_finished() {
            post(&base, "/abort_request", &json!({"rid": rid})).await;
            tokio::task::yield_now().await;
        }
        let (status, body) = long.await.unwrap();
        assert_eq!(status, 200);
        match body["meta_info"]["finish_reason"]["type"].as_str() {
            Some("abort") => {
                aborted = Some(body);
                break;
            }
            Some("length") => assert_eq!(body["meta_info"]["completion_tokens"], 240, "{body}"),
            _ => panic!("{body}"),
        }
    }
    let body = aborted.expect("an abort by request id ended a generation");
    assert!(
        body["meta_info"]["completion_tokens"].as_u64().unwrap() < 240,
        "{body}"
    );

    // The session server on top, through the SGLang client: exact ids and log-probs recorded.
    let backend: Arc<dyn InferenceEngine> = Arc::new(SglangEngine::new(SglangConfig::new(&base)));
    let sessions = SessionServer::new(
        backend,
        Arc::new(tito.clone()),
        SessionServerConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = format!("http://{}", listener.local_addr().unwrap());
    let router = sessions.router();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let created: Value = client
        .post_json(&format!("{front}/sessions"), &json!({}), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    let session = format!(
        "{front}/sessions/{}",
        created["session_id"].as_str().unwrap()
    );
    let r: Value = client
        .post_json(
            &format!("{session}/v1/chat/completions"),
            &json!({"messages": messages, "max_tokens": 6, "temperature": 0}),
            &[],
        )
        .await
        .unwrap()
        .json()
        .unwrap();
    assert!(r["choices"][0]["message"]["content"].is_string(), "{r}");
    let payload: Value = client
        .post_json(
            &format!("{session}/samples"),
            &json!({}),
            &[("accept", "application/json")],
        )
        .await
        .unwrap()
        .json()
        .unwrap();
    let sample: Sample = serde_json::from_value(payload["samples"][0].clone()).unwrap();
    assert_ne!(sample.status, SampleStatus::Aborted);
    assert_eq!(&sample.tokens[..rendered.len()], &rendered[..]);
    assert_eq!(sample.weight_versions, ["5"]);
    // Greedy under version 5 (the same weights): the session's response is the same ids.
    let response = &sample.tokens[rendered.len()..];
    assert_eq!(response, &ids[..response.len()]);
    assert_eq!(
        WeightVersion(5),
        SglangEngine::new(SglangConfig::new(&base))
            .weight_version()
            .await
            .unwrap()
    );
}

/// HF's log-softmax of sequence `seq` at position `p` (the distribution of token `p + 1`).
fn hf_log_softmax(outputs: &NamedTensors, seq: usize, p: usize) -> Vec<f64> {
    let logits = outputs.get("logits").unwrap();
    let [_, len, vocab] = logits.shape().try_into().unwrap();
    let all = logits.to_f32().unwrap();
    let row: Vec<f64> = all[(seq * len + p) * vocab..(seq * len + p + 1) * vocab]
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    let max = row.iter().copied().fold(f64::MIN, f64::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    row.iter().map(|x| x - lse).collect()
}

/// SGLang's input log-probs (`max_new_tokens = 0`, `logprob_start_len = 0`, top-k and
/// requested ids), as an on-policy-distillation teacher is asked, against transformers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_logprobs_on_the_wire_match_transformers() {
    let base = serve(&fixture("serve/qwen3-tiny-chat")).await;
    let (inputs, outputs) = reference("qwen3-tiny");
    let seq = 1;
    let prompt = &inputs[seq];
    let (status, body) = post(
        &base,
        "/generate",
        &json!({"input_ids": prompt, "return_logprob": true, "logprob_start_len": 0,
                "top_logprobs_num": 3, "token_ids_logprob": [5, 7],
                "sampling_params": {"temperature": 0, "max_new_tokens": 0,
                                    "skip_special_tokens": false}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let meta = &body["meta_info"];
    assert_eq!(body["output_ids"], json!([]));
    assert_eq!(meta["completion_tokens"], json!(0));
    let tokens = meta["input_token_logprobs"].as_array().unwrap();
    let top = meta["input_top_logprobs"].as_array().unwrap();
    let ids = meta["input_token_ids_logprobs"].as_array().unwrap();
    assert_eq!(tokens.len(), prompt.len());
    assert_eq!(tokens[0], json!([null, prompt[0], null]));
    assert!(top[0].is_null() && ids[0].is_null());
    for p in 1..prompt.len() {
        let hf = hf_log_softmax(&outputs, seq, p - 1);
        assert_eq!(tokens[p][1], json!(prompt[p]));
        let lp = tokens[p][0].as_f64().unwrap();
        assert!(
            (lp - hf[prompt[p] as usize]).abs() < 1e-4,
            "position {p}: {lp}"
        );
        let mut order: Vec<usize> = (0..hf.len()).collect();
        order.sort_by(|&a, &b| hf[b].total_cmp(&hf[a]));
        for (j, entry) in top[p].as_array().unwrap().iter().enumerate() {
            assert_eq!(entry[1], json!(order[j]), "top {j} at position {p}");
            assert!((entry[0].as_f64().unwrap() - hf[order[j]]).abs() < 1e-4);
        }
        assert_eq!(top[p].as_array().unwrap().len(), 3);
        for (entry, id) in ids[p].as_array().unwrap().iter().zip([5usize, 7]) {
            assert_eq!(entry[1], json!(id));
            assert!((entry[0].as_f64().unwrap() - hf[id]).abs() < 1e-4);
        }
    }
    // Input log-probs with generation are refused (this server scores inputs alone).
    let (status, body) = post(
        &base,
        "/generate",
        &json!({"input_ids": prompt, "return_logprob": true, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 2}}),
    )
    .await;
    assert_eq!(status, 400, "{body}");

    // Per-position ids (`token_ids_logprob_positions`, Miles' `--opd-topk-per-position`):
    // each position's own ids, empty lists over a "prompt", positions past the list none.
    let scored = prompt.len() - 1;
    let lists: Vec<Vec<usize>> = (0..scored)
        .map(|p| match p {
            0 | 1 => vec![],
            p => vec![(3 * p) % 50, p, (3 * p) % 50],
        })
        .collect();
    let (status, body) = post(
        &base,
        "/generate",
        &json!({"input_ids": prompt, "return_logprob": true, "logprob_start_len": 0,
                "token_ids_logprob_positions": lists,
                "sampling_params": {"temperature": 0, "max_new_tokens": 0}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let ids = body["meta_info"]["input_token_ids_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(ids.len(), prompt.len());
    assert!(ids[0].is_null());
    for (p, got) in ids.iter().enumerate().skip(1) {
        let got = got.as_array().unwrap();
        let want = lists.get(p).cloned().unwrap_or_default();
        assert_eq!(got.len(), want.len(), "position {p}");
        let hf = hf_log_softmax(&outputs, seq, p - 1);
        for (entry, &id) in got.iter().zip(&want) {
            assert_eq!(entry[1], json!(id));
            assert!((entry[0].as_f64().unwrap() - hf[id]).abs() < 1e-4);
        }
    }
    for (bad, why) in [
        (
            json!({"token_ids_logprob_positions": [[1]], "token_ids_logprob": [2]}),
            "exclusive",
        ),
        (
            json!({"token_ids_logprob_positions": vec![vec![1]; prompt.len() + 1]}),
            "positions",
        ),
        (
            json!({"token_ids_logprob_positions": [[], [1_000_000]]}),
            "vocabulary",
        ),
    ] {
        let mut request = json!({"input_ids": prompt, "return_logprob": true,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}});
        for (k, v) in bad.as_object().unwrap() {
            request[k] = v.clone();
        }
        let (status, body) = post(&base, "/generate", &request).await;
        assert_eq!(status, 400, "{body}");
        assert!(body.to_string().contains(why), "{body}");
    }
}

/// `/release_memory_occupation` and `/resume_memory_occupation` over loopback HTTP, through
/// miles-session's SGLang client and its router, in Miles' order (release all; resume the
/// weights, update them, resume the KV cache and CUDA graphs): bad tags are 400s, a release is
/// idempotent, generation while released is a 400 naming what is missing (not a wait), and
/// greedy generation after the resume equals before, tokens and log-probs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_release_and_resume_over_http() {
    let dir = fixture("serve/qwen3-tiny-chat");
    let base = serve(&dir).await;
    let client = SglangEngine::new(SglangConfig::new(&base));
    let greedy = || {
        GenerateRequest::new(
            vec![5, 6, 7, 8],
            SamplingParams {
                temperature: 0.0,
                max_new_tokens: Some(8),
                ..SamplingParams::default()
            },
        )
    };
    let before = client.generate(greedy()).await.unwrap();
    assert_eq!(before.output_ids.len(), 8);

    for bad in [
        json!({"tags": ["gpu"]}),
        json!({"tags": "weights"}),
        json!({"tags": [1]}),
    ] {
        for route in ["/release_memory_occupation", "/resume_memory_occupation"] {
            let (status, body) = post(&base, route, &bad).await;
            assert_eq!(status, 400, "{route} {bad}: {body}");
            assert!(
                body["error"]["message"].as_str().unwrap().contains("tag"),
                "{body}"
            );
        }
    }

    // A router whose every engine is down releases nothing, and says so (not an error).
    let dead = miles_session::sglang::Router::over_http(&["http://127.0.0.1:9".into()], |_| {});
    let both = [MemoryTag::Weights, MemoryTag::KvCache];
    assert!(!dead.release_memory_occupation(&both).await.unwrap());

    // Released through a router over the server (fanned out), then again directly:
    // idempotent.
    let router = miles_session::sglang::Router::over_http(std::slice::from_ref(&base), |_| {});
    assert!(router.release_memory_occupation(&both).await.unwrap());
    assert!(client.release_memory_occupation(&both).await.unwrap());
    let (status, body) = post(&base, "/release_memory_occupation", &json!({"tags": null})).await;
    assert_eq!((status, &body["success"]), (200, &json!(true)), "{body}");

    // Generating while released: a clear error at once.
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(10),
        post(&base, "/generate", &json!({"input_ids": [5, 6, 7]})),
    )
    .await
    .expect("answered, not queued");
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("released") && message.contains("update_weights_from_disk"),
        "{message}"
    );
    let err = tokio::time::timeout(Duration::from_secs(10), client.generate(greedy()))
        .await
        .expect("answered, not queued")
        .unwrap_err();
    assert!(err.to_string().contains("released"), "{err}");
    // The KV cache cannot come back before the weights.
    let err = client
        .resume_memory_occupation(&[MemoryTag::KvCache])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("after the weights"), "{err}");

    // Miles' order: resume the weights, update them, resume the KV cache (with cuda_graph).
    let (status, body) = post(
        &base,
        "/resume_memory_occupation",
        &json!({"tags": ["weights"]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    client
        .update_weights_from_disk(&fixture("models/qwen3-tiny"), WeightVersion(1))
        .await
        .unwrap();
    let (status, body) = post(
        &base,
        "/resume_memory_occupation",
        &json!({"tags": ["kv_cache", "cuda_graph"]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(router.resume_memory_occupation(&both).await.unwrap());

    let after = client.generate(greedy()).await.unwrap();
    assert_eq!(after.output_ids, before.output_ids);
    assert_eq!(after.output_log_probs, before.output_log_probs);
    assert_eq!(after.weight_version, WeightVersion(1));
}
