//! The SGLang-protocol client against a real loopback HTTP server that speaks SGLang's JSON
//! (`/generate` and the control endpoints), backed by the deterministic token-id engine.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{ByteChatml, ToyEngine, serve, toy_expert};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use miles_core::{
    DType, EngineErrorKind, FinishReason, GenerateRequest, InferenceEngine, NamedTensors,
    PauseMode, RequestId, SamplingParams, TensorBytes, WeightVersion,
};
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_session::sglang::{SglangConfig, SglangEngine};
use miles_tito::ChatTokenizer;
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Normal,
    NoMeta,
    CountMismatch,
    BadEntry,
    Reject400,
    NotJson,
    Slow,
    UnknownFinish,
}

struct Fake {
    engine: Arc<ToyEngine>,
    mode: Mutex<Mode>,
    seen: Mutex<Vec<(String, Value, Option<String>)>>,
    version: Mutex<String>,
    /// `/get_server_info`'s `dtype` (`None`: the route answers 404, as older servers do).
    served: Mutex<Option<String>>,
    /// The checkpoint read by the last `/update_weights_from_disk`.
    loaded: Mutex<Option<NamedTensors>>,
}

/// Reads a HF checkpoint folder as SGLang does: `model.safetensors.index.json`'s shards when
/// there is an index, else `model.safetensors`.
fn read_checkpoint(dir: &std::path::Path) -> Option<NamedTensors> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<String> = if index.exists() {
        let index: Value = serde_json::from_slice(&std::fs::read(index).ok()?).ok()?;
        let mut files: Vec<String> = index["weight_map"]
            .as_object()?
            .values()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        files.sort();
        files.dedup();
        files
    } else {
        vec!["model.safetensors".to_owned()]
    };
    let mut all = NamedTensors::new();
    for file in files {
        let shard =
            NamedTensors::from_safetensors_bytes(&std::fs::read(dir.join(file)).ok()?).ok()?;
        for (name, tensor) in shard.iter() {
            all.insert(name, tensor.clone());
        }
    }
    Some(all)
}

type S = State<Arc<Fake>>;

fn note(fake: &Fake, path: &str, body: Value, headers: &HeaderMap) {
    let key = headers
        .get("x-smg-routing-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    fake.seen.lock().unwrap().push((path.to_owned(), body, key));
}

async fn generate(State(fake): S, headers: HeaderMap, body: axum::Json<Value>) -> Response {
    note(&fake, "/generate", body.0.clone(), &headers);
    let mode = *fake.mode.lock().unwrap();
    match mode {
        Mode::Reject400 => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": {"message": "context too long"}})),
            )
                .into_response();
        }
        Mode::NotJson => return (StatusCode::OK, "<html>oops</html>").into_response(),
        Mode::Slow => tokio::time::sleep(Duration::from_secs(5)).await,
        _ => {}
    }
    let request: GenerateRequest = serde_json::from_value(body.0).unwrap();
    let out = fake.engine.generate(request.clone()).await.unwrap();
    let tok = ByteChatml::default();
    let mut entries: Vec<Value> = out
        .output_ids
        .iter()
        .zip(&out.output_log_probs)
        .map(|(id, lp)| json!([lp, id, null]))
        .collect();
    let mut completion_tokens = out.output_ids.len();
    let mut finish = json!({"type": out.finish_reason.as_str()});
    if let Some(m) = &out.matched_stop {
        finish["matched"] = m.clone();
    }
    match mode {
        Mode::CountMismatch => completion_tokens += 1,
        Mode::BadEntry => entries[0] = json!(["x", 1, null]),
        Mode::UnknownFinish => finish = json!({"type": "exploded"}),
        _ => {}
    }
    let mut meta = json!({
        "id": request.request_id.map(|r| r.0),
        "finish_reason": finish,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": 3,
        "output_token_logprobs": entries,
        "weight_version": fake.version.lock().unwrap().clone(),
    });
    if let Some(t) = &out.routed_experts {
        meta["routed_experts"] = json!(t.to_base64());
    }
    let body = if mode == Mode::NoMeta {
        json!({"text": tok.decode(&out.output_ids)})
    } else {
        json!({"text": tok.decode(&out.output_ids), "output_ids": out.output_ids, "meta_info": meta})
    };
    axum::Json(body).into_response()
}

async fn control(
    State(fake): S,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    note(&fake, uri.path(), value.clone(), &headers);
    match uri.path() {
        "/update_weights_from_disk" => {
            let path = std::path::PathBuf::from(value["model_path"].as_str().unwrap());
            if path.to_string_lossy().contains("missing") {
                return axum::Json(json!({"success": false, "message": "no such checkpoint"}))
                    .into_response();
            }
            if path.exists() {
                let Some(read) = read_checkpoint(&path) else {
                    return axum::Json(
                        json!({"success": false, "message": "unreadable checkpoint"}),
                    )
                    .into_response();
                };
                *fake.loaded.lock().unwrap() = Some(read);
            }
            *fake.version.lock().unwrap() = value["weight_version"].as_str().unwrap().to_owned();
            axum::Json(json!({"success": true, "message": "ok"})).into_response()
        }
        "/get_server_info" => match fake.served.lock().unwrap().clone() {
            Some(dtype) => axum::Json(json!({"dtype": dtype, "tp_size": 1})).into_response(),
            None => StatusCode::NOT_FOUND.into_response(),
        },
        "/get_weight_version" => {
            axum::Json(json!({"weight_version": fake.version.lock().unwrap().clone()}))
                .into_response()
        }
        _ => axum::Json(json!({"success": true})).into_response(),
    }
}

async fn fake_sglang() -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake {
        engine: ToyEngine::new(),
        mode: Mutex::new(Mode::Normal),
        seen: Mutex::new(Vec::new()),
        version: Mutex::new("default".into()),
        served: Mutex::new(Some("auto".into())),
        loaded: Mutex::new(None),
    });
    let router = Router::new()
        .route("/generate", post(generate))
        .route("/health", get(control))
        .route("/flush_cache", get(control))
        .route("/get_weight_version", get(control))
        .route("/get_server_info", get(control))
        .route("/pause_generation", post(control))
        .route("/continue_generation", post(control))
        .route("/abort_request", post(control))
        .route("/update_weights_from_disk", post(control))
        .with_state(fake.clone());
    (serve(router).await, fake)
}

fn prompt_request(text: &str) -> GenerateRequest {
    let tok = ByteChatml::default();
    let ids = tok.encode(&format!(
        "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    ));
    let params = SamplingParams {
        max_new_tokens: Some(64),
        ..SamplingParams::default()
    };
    GenerateRequest::new(ids, params)
}

#[tokio::test]
async fn generate_round_trips_ids_logprobs_and_routes() {
    let (url, fake) = fake_sglang().await;
    let mut config = SglangConfig::new(url + "/");
    config.num_layers = Some(2);
    let client = SglangEngine::new(config);
    let mut request = prompt_request("hello there");
    request.routing_key = Some("session-42".into());
    request.request_id = Some(RequestId::new("r-1"));
    request.return_routed_experts = true;
    let got = client.generate(request.clone()).await.unwrap();
    let direct = ToyEngine::new().generate(request.clone()).await.unwrap();
    assert_eq!(got.output_ids, direct.output_ids);
    assert_eq!(got.output_log_probs, direct.output_log_probs);
    assert_eq!(got.finish_reason, FinishReason::Stop);
    assert_eq!(got.matched_stop, Some(json!(257)));
    assert_eq!(
        got.weight_version,
        WeightVersion(0),
        "\"default\" is version 0"
    );
    assert_eq!(got.cached_tokens, 3);
    assert_eq!(got.request_id, Some(RequestId::new("r-1")));
    let table = got.routed_experts.unwrap();
    assert_eq!(
        table.shape(),
        [request.input_ids.len() + got.output_ids.len() - 1, 2, 2]
    );
    assert_eq!(
        table.get(5, 1).unwrap(),
        &[toy_expert(5, 1, 0), toy_expert(5, 1, 1)]
    );
    let seen = fake.seen.lock().unwrap();
    let (path, body, key) = &seen[0];
    assert_eq!(path, "/generate");
    assert_eq!(key.as_deref(), Some("session-42"));
    assert_eq!(body["return_logprob"], json!(true));
    assert_eq!(body["return_routed_experts"], json!(true));
    assert_eq!(body["rid"], json!("r-1"));
    assert_eq!(body["sampling_params"]["max_new_tokens"], json!(64));
    assert_eq!(body["sampling_params"]["no_stop_trim"], json!(false));
    assert_eq!(body["input_ids"], json!(request.input_ids));
}

#[tokio::test]
async fn control_endpoints_use_sglang_paths_and_bodies() {
    let (url, fake) = fake_sglang().await;
    let dir = std::env::temp_dir().join(format!("miles-session-test-{}", std::process::id()));
    let mut config = SglangConfig::new(url);
    config.shared_weights_dir = Some(dir.clone());
    let client = SglangEngine::new(config);
    client.health().await.unwrap();
    client.pause(PauseMode::InPlace).await.unwrap();
    client.resume().await.unwrap();
    client.flush_cache().await.unwrap();
    client.abort(&RequestId::new("r-9")).await.unwrap();
    client.abort_all().await.unwrap();
    client
        .update_weights_from_disk(std::path::Path::new("/ckpt/step8"), WeightVersion(8))
        .await
        .unwrap();
    assert_eq!(client.weight_version().await.unwrap(), WeightVersion(8));
    let mut weights = NamedTensors::new();
    weights.insert("w", TensorBytes::from_f32(vec![2], &[1.0, 2.0]).unwrap());
    client
        .update_weights(&weights, WeightVersion(9))
        .await
        .unwrap();
    // SGLang's default `--dtype auto` serves the checkpoint's dtype: bf16 is written.
    assert!(dir.join("v9-bf16/model.safetensors").exists());
    let loaded = fake.loaded.lock().unwrap().clone().unwrap();
    assert_eq!(
        loaded.get("w"),
        weights.get("w").unwrap().cast(DType::BF16).ok().as_ref()
    );
    assert_eq!(client.weight_version().await.unwrap(), WeightVersion(9));
    let err = client
        .update_weights_from_disk(std::path::Path::new("/missing"), WeightVersion(10))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            miles_core::Error::Engine {
                kind: EngineErrorKind::WeightUpdate,
                ..
            }
        ),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let seen: Vec<(String, Value)> = fake
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|(p, b, _)| (p.clone(), b.clone()))
        .collect();
    assert_eq!(
        seen[..7],
        [
            ("/health".into(), Value::Null),
            ("/pause_generation".into(), json!({"mode": "in_place"})),
            ("/continue_generation".into(), json!({})),
            ("/flush_cache".into(), Value::Null),
            ("/abort_request".into(), json!({"rid": "r-9"})),
            ("/abort_request".into(), json!({"abort_all": true})),
            (
                "/update_weights_from_disk".into(),
                json!({"model_path": "/ckpt/step8", "weight_version": "8", "flush_cache": true})
            ),
        ]
    );
}

#[tokio::test]
async fn malformed_or_failing_engines_give_clear_errors() {
    let (url, fake) = fake_sglang().await;
    let mut config = SglangConfig::new(url);
    config.generate_timeout = Duration::from_millis(300);
    let client = SglangEngine::new(config);
    let cases = [
        (
            Mode::NoMeta,
            EngineErrorKind::Protocol,
            "missing field `meta_info`",
        ),
        (
            Mode::CountMismatch,
            EngineErrorKind::Protocol,
            "completion_tokens",
        ),
        (
            Mode::BadEntry,
            EngineErrorKind::Protocol,
            "output_token_logprobs[0]",
        ),
        (Mode::UnknownFinish, EngineErrorKind::Protocol, "exploded"),
        (Mode::NotJson, EngineErrorKind::Protocol, "non-JSON"),
        (
            Mode::Reject400,
            EngineErrorKind::InvalidRequest,
            "context too long",
        ),
        (Mode::Slow, EngineErrorKind::Unavailable, "timed out"),
    ];
    for (mode, kind, text) in cases {
        *fake.mode.lock().unwrap() = mode;
        let err = client.generate(prompt_request("hi")).await.unwrap_err();
        match &err {
            miles_core::Error::Engine { kind: k, message } => {
                assert_eq!(*k, kind, "{mode:?}: {err}");
                assert!(message.contains(text), "{mode:?}: {message}");
            }
            other => panic!("{mode:?}: {other}"),
        }
    }
    // Nothing listens on this port.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let dead = SglangEngine::new(SglangConfig::new(format!("http://127.0.0.1:{port}")));
    let err = dead.health().await.unwrap_err();
    assert!(
        matches!(
            err,
            miles_core::Error::Engine {
                kind: EngineErrorKind::Unavailable,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn session_server_over_sglang_client_end_to_end() {
    let (url, fake) = fake_sglang().await;
    let engine = Arc::new(SglangEngine::new(SglangConfig::new(url)));
    let server = SessionServer::new(
        engine,
        Arc::new(ByteChatml::default()),
        SessionServerConfig::default(),
    );
    let base = serve(server.router()).await;
    let http = HttpClient::new(Duration::from_secs(10));
    let created: Value = http
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    let id = created["session_id"].as_str().unwrap();
    let r = http
        .post_json(
            &format!("{base}/sessions/{id}/v1/chat/completions"),
            &json!({"messages": [{"role": "user", "content": "ping"}]}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = r.json().unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        json!("You said: ping")
    );
    assert_eq!(v["choices"][0]["meta_info"]["weight_version"], json!("0"));
    let key = fake.seen.lock().unwrap()[0].2.clone();
    assert_eq!(
        key.as_deref(),
        Some(id),
        "sticky routing key is the session id"
    );
    // Engine rejection (context too long) reaches the client as 400, unrecorded.
    *fake.mode.lock().unwrap() = Mode::Reject400;
    let r = http
        .post_json(
            &format!("{base}/sessions/{id}/v1/chat/completions"),
            &json!({"messages": [{"role": "user", "content": "other"}]}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    let s: Value = http
        .get(&format!("{base}/sessions/{id}"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(s["records"].as_array().unwrap().len(), 1);
}

/// A fleet sharing one [`WeightPublisher`]: each version is written once whatever the number
/// of engines, every engine is pointed at that one folder, old versions are removed past
/// `keep`, and a folder left by an earlier run is rewritten, never trusted.
#[tokio::test]
async fn a_shared_publisher_writes_each_version_once_and_keeps_the_newest() {
    use miles_session::sglang::WeightPublisher;
    let root = std::env::temp_dir().join(format!("miles-publisher-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // A stale v3 from a killed run, with other contents.
    std::fs::create_dir_all(root.join("v3-bf16")).unwrap();
    std::fs::write(root.join("v3-bf16/model.safetensors"), b"stale").unwrap();
    let publisher = Arc::new(WeightPublisher::new(&root).with_keep(2));
    let (url_a, fake_a) = fake_sglang().await;
    let (url_b, fake_b) = fake_sglang().await;
    let a = SglangEngine::new(SglangConfig::new(url_a).with_publisher(publisher.clone()));
    let b = SglangEngine::new(SglangConfig::new(url_b).with_publisher(publisher.clone()));
    for version in 1..=3u64 {
        let mut weights = NamedTensors::new();
        weights.insert(
            "w",
            TensorBytes::from_f32(vec![2], &[version as f32, 0.5]).unwrap(),
        );
        let (ra, rb) = tokio::join!(
            a.update_weights(&weights, WeightVersion(version)),
            b.update_weights(&weights, WeightVersion(version))
        );
        ra.unwrap();
        rb.unwrap();
        assert_eq!(publisher.writes(), version, "one write per version");
        let dir = root.join(format!("v{version}-bf16"));
        for fake in [&fake_a, &fake_b] {
            let seen = fake.seen.lock().unwrap();
            let (_, body, _) = seen
                .iter()
                .rev()
                .find(|(p, _, _)| p == "/update_weights_from_disk")
                .unwrap();
            assert_eq!(body["model_path"], json!(dir.to_string_lossy()));
            assert_eq!(body["weight_version"], json!(version.to_string()));
        }
        let read = read_checkpoint(&dir).unwrap();
        let want = weights.get("w").unwrap().cast(DType::BF16).unwrap();
        assert_eq!(read.get("w").unwrap(), &want);
        for fake in [&fake_a, &fake_b] {
            assert_eq!(
                fake.loaded.lock().unwrap().as_ref().unwrap().get("w"),
                Some(&want)
            );
        }
    }
    // keep = 2: v1 is gone, v2 and v3 remain; no temporary folder is left behind.
    assert!(!root.join("v1-bf16").exists());
    assert!(root.join("v2-bf16").exists() && root.join("v3-bf16").exists());
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    std::fs::remove_dir_all(&root).ok();
}

/// Each engine gets the version in the dtype it serves (`/get_server_info`'s `dtype`): one
/// write per (version, dtype) however many engines share it, bf16 for a server that does
/// not say, f32 / f16 for servers that serve them, an explicit cast or the exported tensors
/// when configured; shards with an index past the shard size; `keep` counts versions, not
/// dtypes.
#[tokio::test]
async fn weights_are_written_in_the_dtype_each_engine_serves() {
    use miles_session::sglang::{WeightDtype, WeightPublisher};
    let root = std::env::temp_dir().join(format!("miles-dtypes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // a 4, w 8, z.ids 4 bytes in bf16 / f16: three shards of at most 8 bytes.
    let publisher = Arc::new(
        WeightPublisher::new(&root)
            .with_keep(1)
            .with_max_shard_bytes(8),
    );
    let mut fakes = Vec::new();
    let mut engines = Vec::new();
    let setups: [(Option<&str>, WeightDtype); 6] = [
        (Some("float32"), WeightDtype::Served),
        (Some("float16"), WeightDtype::Served),
        (Some("half"), WeightDtype::Served),
        (None, WeightDtype::Served),
        (Some("float32"), WeightDtype::Cast(DType::BF16)),
        (Some("bfloat16"), WeightDtype::Exported),
    ];
    for (served, dtype) in setups {
        let (url, fake) = fake_sglang().await;
        *fake.served.lock().unwrap() = served.map(str::to_owned);
        let config = SglangConfig::new(url)
            .with_publisher(publisher.clone())
            .with_weight_dtype(dtype);
        engines.push(SglangEngine::new(config));
        fakes.push(fake);
    }
    let want = [
        Some(DType::F32),
        Some(DType::F16),
        Some(DType::F16),
        Some(DType::BF16),
        Some(DType::BF16),
        None,
    ];
    for (engine, want) in engines.iter().zip(want) {
        assert_eq!(engine.weight_dtype().await.unwrap(), want);
    }
    // torch: tensor([1 + 2^-8, 70000.0, -2.5, 0.1, 3.0, 65504.0]).to(dtype).view(int16)
    let values = [1.003_906_3f32, 70000.0, -2.5, 0.1, 3.0, 65504.0];
    let mut weights = NamedTensors::new();
    weights.insert("a", TensorBytes::from_f32(vec![2], &values[..2]).unwrap());
    weights.insert("w", TensorBytes::from_f32(vec![4], &values[2..]).unwrap());
    weights.insert(
        "z.ids",
        TensorBytes::new(DType::I32, vec![1], 7i32.to_le_bytes().to_vec()).unwrap(),
    );
    for version in [1u64, 2] {
        for engine in &engines {
            engine
                .update_weights(&weights, WeightVersion(version))
                .await
                .unwrap();
        }
        // f32, f16, bf16 and the exported copy: four writes per version.
        assert_eq!(publisher.writes(), 4 * version);
    }
    let bits = |t: &TensorBytes| -> Vec<u16> {
        t.data()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    };
    let f16_bits = [15364u16, 31744, 49408, 11878, 16896, 31743];
    let bf16_bits = [16256u16, 18313, 49184, 15821, 16448, 18304];
    for (i, fake) in fakes.iter().enumerate() {
        let loaded = fake.loaded.lock().unwrap().clone().unwrap();
        assert_eq!(
            loaded.get("z.ids"),
            weights.get("z.ids"),
            "ids keep their dtype"
        );
        let (a, w) = (loaded.get("a").unwrap(), loaded.get("w").unwrap());
        match want[i] {
            Some(DType::F16) | Some(DType::BF16) => {
                let want_bits = if want[i] == Some(DType::F16) {
                    f16_bits
                } else {
                    bf16_bits
                };
                assert_eq!(a.dtype(), want[i].unwrap());
                assert_eq!([bits(a), bits(w)].concat(), want_bits, "engine {i}");
            }
            _ => {
                assert_eq!(a, weights.get("a").unwrap());
                assert_eq!(w, weights.get("w").unwrap());
            }
        }
        let seen = fake.seen.lock().unwrap();
        let paths: Vec<&str> = seen
            .iter()
            .filter(|(p, _, _)| p == "/update_weights_from_disk")
            .map(|(_, b, _)| b["model_path"].as_str().unwrap())
            .collect();
        let suffix = want[i].map_or(String::new(), |d| format!("-{}", d.name().to_lowercase()));
        assert_eq!(paths.len(), 2);
        assert!(paths[1].ends_with(&format!("v2{suffix}")), "{paths:?}");
        // The dtype is asked once per engine.
        let asked = seen
            .iter()
            .filter(|(p, _, _)| p == "/get_server_info")
            .count();
        let expected_asks = usize::from(matches!(setups[i].1, WeightDtype::Served));
        assert_eq!(asked, expected_asks, "engine {i}");
    }
    // The versions are sharded (in bf16, 16 bytes of tensor data over 8-byte shards: [a] [w]
    // [z.ids]), with an index; keep = 1 removed every dtype of version 1.
    assert!(root.join("v2-bf16/model.safetensors.index.json").exists());
    assert!(
        root.join("v2-f16/model-00003-of-00003.safetensors")
            .exists()
    );
    let mut dirs: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    assert_eq!(dirs, ["v2", "v2-bf16", "v2-f16", "v2-f32"]);
    std::fs::remove_dir_all(&root).ok();
}
