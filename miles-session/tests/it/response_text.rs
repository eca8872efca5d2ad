//! The response text as SGLang gives it (issue 45, point 5): a model that stops on its EOS
//! (`<|im_end|>`, a special token of the Qwen3 tokenizer) answers `/generate` with the text
//! without it — SGLang's defaults `skip_special_tokens=True`, `no_stop_trim=False` — while
//! `output_ids` and the log-probs keep the stop token; each switch brings it back as SGLang's
//! detokenizer does. Run on the tiny Qwen3 chat checkpoint's tokenizer (fixtures/serve).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use miles_session::http::HttpClient;
use miles_session::sglang::{ServerInfo, sglang_router};
use miles_session::testkit::InstantEngine;
use miles_tito::{ChatTokenizer, TitoChat};
use serde_json::{Value, json};

fn chat() -> Arc<TitoChat> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/serve/qwen3-tiny-chat");
    Arc::new(TitoChat::load(&dir, "qwen3").unwrap())
}

async fn serve() -> String {
    let chat = chat();
    let engine = InstantEngine::for_chatml(chat.as_ref()).unwrap();
    let info = ServerInfo::new("qwen3-tiny-chat").with_tokenizer(chat, "qwen3-tiny-chat");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = sglang_router(engine, info);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

async fn generate(base: &str, sampling: Value) -> Value {
    let body = json!({"text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                      "sampling_params": sampling, "return_logprob": true});
    let r = HttpClient::new(Duration::from_secs(30))
        .post_json(&format!("{base}/generate"), &body, &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json().unwrap()
}

#[tokio::test]
async fn generate_text_skips_the_matched_eos_as_sglang_does() {
    let base = serve().await;
    let im_end = chat().stop_token_ids()[0];
    // In the Qwen3 tokenizer `<|im_end|>` is special, `<think>` / `<tool_call>` are not: the
    // skip leaves them in the text.
    let reply = InstantEngine::TOOL_CALL;
    let cases = [
        (json!({"max_new_tokens": 200}), reply.to_string()),
        (
            json!({"max_new_tokens": 200, "skip_special_tokens": false}),
            reply.to_string(),
        ),
        (
            json!({"max_new_tokens": 200, "no_stop_trim": true}),
            reply.to_string(),
        ),
        (
            json!({"max_new_tokens": 200, "skip_special_tokens": false, "no_stop_trim": true}),
            format!("{reply}<|im_end|>"),
        ),
    ];
    for (sampling, want) in cases {
        let answer = generate(&base, sampling.clone()).await;
        assert_eq!(answer["text"], json!(want), "{sampling}");
        let ids = answer["output_ids"].as_array().unwrap();
        assert_eq!(ids.last(), Some(&json!(im_end)), "ids keep the stop token");
        let logprobs = answer["meta_info"]["output_token_logprobs"]
            .as_array()
            .unwrap();
        assert_eq!(logprobs.len(), ids.len(), "log-probs keep the stop token");
        assert_eq!(
            answer["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": im_end})
        );
    }
}

#[tokio::test]
async fn a_length_cut_trims_nothing() {
    let base = serve().await;
    let chat = chat();
    let answer = generate(&base, json!({"max_new_tokens": 3})).await;
    let ids: Vec<u32> = serde_json::from_value(answer["output_ids"].clone()).unwrap();
    assert_eq!(ids.len(), 3);
    assert_eq!(answer["text"], json!(chat.decode(&ids)));
    assert_eq!(
        answer["meta_info"]["finish_reason"]["type"],
        json!("length")
    );
}

/// A session server on the tiny Qwen3 checkpoint's tokenizer over the instant engine.
async fn session_server(config: miles_session::server::SessionServerConfig) -> String {
    let chat = chat();
    let engine = InstantEngine::for_chatml(chat.as_ref()).unwrap();
    let server = miles_session::server::SessionServer::new(engine, chat, config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = server.router();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

/// One chat turn in a fresh session: the answer and the prompt ids the session recorded.
async fn one_turn(base: &str, body: Value) -> (Value, Vec<u32>) {
    let (answer, ids, _) = turn_and_samples(base, body).await;
    (answer, ids)
}

/// One chat turn, then the session's samples as JSON (`POST …/samples`, no Content-Type, as
/// Miles' tests send it).
async fn turn_and_samples(base: &str, body: Value) -> (Value, Vec<u32>, Value) {
    let http = HttpClient::new(Duration::from_secs(30));
    let created: Value = http
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    let session = format!(
        "{base}/sessions/{}",
        created["session_id"].as_str().unwrap()
    );
    let r = http
        .post_json(&format!("{session}/v1/chat/completions"), &body, &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let answer: Value = r.json().unwrap();
    let state: Value = http
        .send(hyper::Method::GET, &session, &[], None)
        .await
        .unwrap()
        .json()
        .unwrap();
    let ids = serde_json::from_value(state["records"][0]["request"]["input_ids"].clone()).unwrap();
    let samples = http
        .send(
            hyper::Method::POST,
            &format!("{session}/samples"),
            &[("accept", "application/json")],
            Some(("", b"{}".to_vec())),
        )
        .await
        .unwrap();
    assert_eq!(samples.status, 200, "{}", samples.text());
    (answer, ids, samples.json().unwrap())
}

#[tokio::test]
async fn the_developer_role_reaches_the_template_and_server_kwargs_apply_to_every_render() {
    let base = session_server(Default::default()).await;
    let chat = chat();
    let user = json!({"role": "user", "content": "hi"});
    // Qwen3's template renders no `developer` turn (it knows system, user, assistant, tool):
    // the prompt is the user's alone, as HF's apply_chat_template gives it.
    let (answer, ids) = one_turn(
        &base,
        json!({"messages": [{"role": "developer", "content": "be brief"}, user]}),
    )
    .await;
    assert_eq!(answer["choices"][0]["finish_reason"], json!("tool_calls"));
    let alone = chat
        .render(
            &[serde_json::from_value(user.clone()).unwrap()],
            &[],
            true,
            &chat.resolve_kwargs(&Default::default()).unwrap(),
        )
        .unwrap();
    assert_eq!(ids, alone);

    // `--apply-chat-template-kwargs {"enable_thinking": false}`: Qwen3's generation prompt
    // gains the empty think block on every render, without the request asking.
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let config = miles_session::server::SessionServerConfig {
        chat_template_kwargs: kwargs.clone(),
        ..Default::default()
    };
    let base = session_server(config).await;
    let (_, ids) = one_turn(&base, json!({"messages": [user]})).await;
    let text = chat.decode(&ids);
    assert!(
        text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{text:?}"
    );
}

#[tokio::test]
async fn session_samples_carry_miles_metadata_and_sglang_text() {
    let user = json!({"role": "user", "content": "hi"});
    let base = session_server(Default::default()).await;
    let (_, _, samples) = turn_and_samples(&base, json!({"messages": [user]})).await;
    let sample = &samples["samples"][0];
    // The text without the end of turn; the tokens keep it.
    assert_eq!(sample["response"], json!(InstantEngine::TOOL_CALL));
    let im_end = chat().stop_token_ids()[0];
    assert_eq!(
        sample["tokens"].as_array().unwrap().last(),
        Some(&json!(im_end))
    );
    // Miles' lifecycle segment of the turn; no messages without the debug flag.
    let lifecycle = &sample["metadata"]["lifecycle"];
    assert_eq!(lifecycle["turn"], json!(1));
    let (t0, t1) = (
        lifecycle["t0"].as_f64().unwrap(),
        lifecycle["t1"].as_f64().unwrap(),
    );
    assert!(t0 <= t1, "{lifecycle}");
    assert!(lifecycle["req_ts"].as_f64().unwrap() <= t1, "{lifecycle}");
    assert!(sample["metadata"].get("messages").is_none(), "{sample}");

    let base = session_server(miles_session::server::SessionServerConfig {
        save_debug_trajectory_data: true,
        ..Default::default()
    })
    .await;
    let (_, _, samples) = turn_and_samples(&base, json!({"messages": [user]})).await;
    let messages = &samples["samples"][0]["metadata"]["messages"];
    assert_eq!(messages[0], user);
    assert_eq!(messages[1]["role"], json!("assistant"));
}
