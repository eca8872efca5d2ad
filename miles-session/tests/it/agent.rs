//! The agent driver against a real session server on loopback; agents talk to it with a real
//! HTTP client in the OpenAI chat-completions shape.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{ByteChatml, ToyEngine, WeatherAgent, serve};
use miles_core::{Message, Prompt, Reward, Sample, SampleStatus, SamplingParams, async_trait};
use miles_session::agent::{
    AGENT_REWARD_KEY, Agent, AgentContext, AgentDriverConfig, generate, generate_samples,
    request_kwargs,
};
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use serde_json::{Map, Value, json};

struct SleepyAgent;

#[async_trait]
impl Agent for SleepyAgent {
    async fn run(&self, _ctx: AgentContext) -> Result<Map<String, Value>, String> {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Ok(Map::new())
    }
}

struct IdleAgent;

#[async_trait]
impl Agent for IdleAgent {
    async fn run(&self, ctx: AgentContext) -> Result<Map<String, Value>, String> {
        assert!(ctx.base_url.contains("/sessions/"));
        Ok(Map::new())
    }
}

/// Runs the weather agent and returns `reward` under the reserved key.
struct RewardingAgent(Value);

#[async_trait]
impl Agent for RewardingAgent {
    async fn run(&self, ctx: AgentContext) -> Result<Map<String, Value>, String> {
        let mut m = WeatherAgent {
            fail_after_first_turn: false,
        }
        .run(ctx)
        .await?;
        m.insert(AGENT_REWARD_KEY.into(), self.0.clone());
        Ok(m)
    }
}

async fn setup() -> (String, SessionServer) {
    let server = SessionServer::new(
        ToyEngine::new(),
        Arc::new(ByteChatml::default()),
        SessionServerConfig::default(),
    );
    (serve(server.router()).await, server)
}

fn input_sample() -> Sample {
    let mut s = Sample::builder(Prompt::Messages(vec![
        Message::system("You are helpful."),
        Message::user("What is the weather in Lyon?"),
    ]))
    .ids(3, 12)
    .label("sunny")
    .build()
    .unwrap();
    s.metadata.insert("task".into(), json!("weather"));
    s
}

#[tokio::test]
async fn agent_conversation_becomes_one_merged_sample() {
    let (url, server) = setup().await;
    let http = HttpClient::new(Duration::from_secs(10));
    let params = SamplingParams {
        max_new_tokens: Some(200),
        sampling_seed: Some(5),
        ..SamplingParams::default()
    };
    let config = AgentDriverConfig::new(&url);
    let agent = WeatherAgent {
        fail_after_first_turn: false,
    };
    let out = generate(&agent, &input_sample(), &params, &config, &http).await;
    assert_eq!(
        out.status,
        SampleStatus::Completed,
        "{:?}",
        out.metadata.get("failure")
    );
    assert_eq!(
        (out.group_index, out.index, out.label.as_deref()),
        (Some(3), Some(12), Some("sunny"))
    );
    assert_eq!(out.metadata["task"], json!("weather"));
    assert_eq!(out.metadata["turns"], json!(2));
    assert_eq!(out.non_generation_time, 0.25);
    assert_eq!(out.weight_versions, vec!["7", "7"]);
    let acc: Vec<u32> =
        serde_json::from_value(out.metadata["accumulated_token_ids"].clone()).unwrap();
    assert_eq!(out.tokens, acc);
    // SGLang's text: the final `<|im_end|>` (special) is skipped; the ids keep it.
    assert!(
        out.response.ends_with("The weather is sunny."),
        "{}",
        out.response
    );
    assert!(!out.response.contains("<|im_end|>"), "{}", out.response);
    assert_eq!(out.tokens.last(), Some(&miles_session::testkit::IM_END));
    let mask = out.loss_mask.clone().unwrap();
    assert_eq!(mask.len(), out.response_length);
    assert_eq!((mask[0], *mask.last().unwrap()), (1, 1));
    assert!(mask.contains(&0), "tool observation is masked");
    assert_eq!(server.sessions_open(), 0, "session deleted");
}

#[tokio::test]
async fn failures_become_failed_samples_and_sessions_are_deleted() {
    let (url, server) = setup().await;
    let http = HttpClient::new(Duration::from_secs(10));
    let params = SamplingParams::default();
    let mut config = AgentDriverConfig::new(&url);
    // Well past any agent here that finishes (a loaded CI machine must not turn a crash into
    // a timeout); the sleeping agent gets a short one of its own below.
    config.agent_timeout = Some(Duration::from_secs(10));
    let input = input_sample();

    let failing = WeatherAgent {
        fail_after_first_turn: true,
    };
    let out = generate(&failing, &input, &params, &config, &http).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert!(
        out.metadata["failure"]
            .as_str()
            .unwrap()
            .contains("tool crashed")
    );
    assert_eq!(out.tokens, input.tokens);

    let mut short = config.clone();
    short.agent_timeout = Some(Duration::from_millis(200));
    let out = generate(&SleepyAgent, &input, &params, &short, &http).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert!(
        out.metadata["failure"]
            .as_str()
            .unwrap()
            .contains("timed out")
    );

    let out = generate(&IdleAgent, &input, &params, &config, &http).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert_eq!(out.metadata["failure"], json!("empty session"));
    assert_eq!(server.sessions_open(), 0);

    // Miles' behaviour on request: a failed agent's recorded turns are still trained on.
    config.abort_on_agent_error = false;
    let out = generate(&failing, &input, &params, &config, &http).await;
    assert_eq!(out.status, SampleStatus::Completed);
    assert!(out.response_length > 0);

    // Unreachable server.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let dead = AgentDriverConfig::new(format!("http://127.0.0.1:{port}"));
    let out = generate(&IdleAgent, &input, &params, &dead, &http).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert_eq!(server.sessions_open(), 0);
}

#[tokio::test]
async fn an_agent_reward_becomes_the_sample_reward() {
    let (url, server) = setup().await;
    let http = HttpClient::new(Duration::from_secs(10));
    let config = AgentDriverConfig::new(&url);
    let params = SamplingParams::default();
    let input = input_sample();

    let out = generate(
        &RewardingAgent(json!(0.75)),
        &input,
        &params,
        &config,
        &http,
    )
    .await;
    assert_eq!(out.status, SampleStatus::Completed);
    assert_eq!(out.reward, Some(Reward::Scalar(0.75)));
    assert!(!out.metadata.contains_key(AGENT_REWARD_KEY));
    assert_eq!(out.metadata["turns"], json!(2));

    let named = json!({"accuracy": 1, "length_penalty": -0.5});
    let out = generate(
        &RewardingAgent(named.clone()),
        &input,
        &params,
        &config,
        &http,
    )
    .await;
    assert_eq!(out.status, SampleStatus::Completed);
    let Some(Reward::Map(map)) = &out.reward else {
        panic!("{:?}", out.reward)
    };
    assert_eq!(Value::Object(map.clone()), named);
    assert_eq!(out.scalar_reward(Some("length_penalty")), Some(-0.5));

    for bad in [json!("high"), json!(null), json!([1.0])] {
        let out = generate(&RewardingAgent(bad), &input, &params, &config, &http).await;
        assert_eq!(out.status, SampleStatus::Failed);
        assert_eq!(
            out.metadata["failure"],
            json!("agent failed: agent_reward must be a number or an object")
        );
        assert_eq!(out.reward, None);
    }
    assert_eq!(server.sessions_open(), 0);
}

#[test]
fn sampling_params_are_renamed_for_chat_requests() {
    let params = SamplingParams {
        max_new_tokens: Some(32),
        min_new_tokens: 2,
        sampling_seed: Some(9),
        stop: vec!["END".into()],
        ..SamplingParams::default()
    };
    let kw = request_kwargs(&params);
    assert_eq!(kw["max_tokens"], json!(32));
    assert_eq!(kw["min_tokens"], json!(2));
    assert_eq!(kw["seed"], json!(9));
    assert_eq!(kw["stop"], json!(["END"]));
    assert_eq!(kw["temperature"], json!(1.0));
    assert!(!kw.contains_key("max_new_tokens") && !kw.contains_key("frequency_penalty"));
}

#[tokio::test]
async fn generate_multi_samples_gives_one_sample_per_turn_with_one_rollout_id() {
    let (url, server) = setup().await;
    let http = HttpClient::new(Duration::from_secs(10));
    let params = SamplingParams {
        max_new_tokens: Some(200),
        sampling_seed: Some(5),
        ..SamplingParams::default()
    };
    let agent = RewardingAgent(json!(0.75));
    // The merged sample of the same conversation (the toy engine is deterministic).
    let merged_config = AgentDriverConfig::new(&url);
    let merged = generate(&agent, &input_sample(), &params, &merged_config, &http).await;
    assert_eq!(merged.status, SampleStatus::Completed);
    let config = AgentDriverConfig::new(&url).with_generate_multi_samples(true);
    let turns = generate_samples(&agent, &input_sample(), &params, &config, &http).await;
    assert_eq!(turns.len(), 2, "two turns, two samples");
    let (first, last) = (&turns[0], &turns[1]);
    for s in &turns {
        s.validate().unwrap();
        assert_eq!(s.status, SampleStatus::Completed);
        assert_eq!((s.group_index, s.index), (Some(3), Some(12)));
        assert_eq!(
            s.rollout_id,
            Some(12),
            "siblings carry the input's index as rollout id"
        );
        assert_eq!(
            s.reward,
            Some(Reward::Scalar(0.75)),
            "one reward, on every sibling"
        );
        assert_eq!(s.metadata["task"], json!("weather"));
        // Each turn trains exactly on its own response.
        assert_eq!(
            s.loss_mask.as_deref(),
            Some(&vec![1u8; s.response_length][..])
        );
        assert_eq!(s.weight_versions, vec!["7"]);
    }
    // Session metadata (the accumulated ids) only on the last sibling; the messages only with
    // `save_debug_trajectory_data` (Miles' `--save-debug-trajectory-data`); a lifecycle
    // segment per turn.
    assert!(!first.metadata.contains_key("accumulated_token_ids"));
    assert!(last.metadata.contains_key("accumulated_token_ids"));
    assert!(!last.metadata.contains_key("messages"));
    assert_eq!(first.metadata["lifecycle"]["turn"], json!(1));
    assert_eq!(last.metadata["lifecycle"]["turn"], json!(2));
    // The turns tile the merged sample: turn 0, the tool observation (masked), turn 1.
    assert_eq!(last.tokens, merged.tokens);
    assert!(last.tokens.starts_with(&first.tokens));
    let obs = last.tokens.len() - first.tokens.len() - last.response_length;
    assert!(obs > 0);
    let mut mask = vec![1u8; first.response_length];
    mask.extend(vec![0u8; obs]);
    mask.extend(vec![1u8; last.response_length]);
    assert_eq!(merged.loss_mask.as_ref(), Some(&mask));
    let mut log_probs = first.rollout_log_probs.clone().unwrap();
    log_probs.extend(vec![0.0; obs]);
    log_probs.extend(last.rollout_log_probs.clone().unwrap());
    assert_eq!(merged.rollout_log_probs, Some(log_probs));
    assert_eq!(
        merged.response_length,
        first.response_length + obs + last.response_length
    );
    // Off, generate_samples is the merged sample.
    let one = generate_samples(&agent, &input_sample(), &params, &merged_config, &http).await;
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].tokens, merged.tokens);
    assert_eq!(one[0].rollout_id, None);
    assert_eq!(server.sessions_open(), 0, "sessions deleted");
}
