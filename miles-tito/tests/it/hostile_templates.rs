//! Chat templates are untrusted input: a template that loops (practically) forever, recurses
//! without end or writes gigabytes fails fast with a typed `RenderLimit` error, in the library
//! (and in `miles tito`, exit code 2: miles-cli's tests), and the same template object keeps working for
//! well-behaved calls.

use std::time::{Duration, Instant};

use miles_tito::{ChatTemplate, Error, RenderArgs, RenderLimits};
use serde_json::{Map, Value, json};

fn render(template: &ChatTemplate, messages: &[Value]) -> Result<String, Error> {
    template.render(RenderArgs {
        messages,
        tools: None,
        add_generation_prompt: false,
        kwargs: &Map::new(),
    })
}

fn hi() -> Vec<Value> {
    vec![json!({"role": "user", "content": "hi"})]
}

/// A template that renders normally for a short conversation and misbehaves when asked to.
fn hostile(body: &str) -> String {
    format!(
        "{{% if messages[0].content == 'go' %}}{body}{{% else %}}{{% for m in messages %}}<{{{{ m.role }}}}>{{{{ m.content }}}}{{% endfor %}}{{% endif %}}"
    )
}

fn go() -> Vec<Value> {
    vec![json!({"role": "user", "content": "go"})]
}

#[track_caller]
fn assert_limit(result: Result<String, Error>, which: &str, started: Instant) {
    match result {
        Err(Error::RenderLimit { limit, detail }) => {
            assert_eq!(limit, which, "{detail}");
        }
        other => panic!("expected a {which} limit, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn endless_loops_run_out_of_fuel() {
    let t = ChatTemplate::new(hostile(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% set c = a * b %}{% endfor %}{% endfor %}",
    ))
    .unwrap()
    .with_render_limits(RenderLimits::default().with_fuel(Some(2_000_000)))
    .unwrap();
    let started = Instant::now();
    assert_limit(render(&t, &go()), "fuel", started);
    let message = render(&t, &go()).unwrap_err().to_string();
    assert!(
        message.contains("fuel limit (more than 2000000 instructions)"),
        "{message}"
    );
    // The same template still renders a normal conversation.
    assert_eq!(render(&t, &hi()).unwrap(), "<user>hi");
    // The default limits stop it too.
    let t = ChatTemplate::new(hostile(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    ))
    .unwrap();
    assert_eq!(t.render_limits(), RenderLimits::default());
    let started = Instant::now();
    assert_limit(render(&t, &go()), "fuel", started);
}

#[test]
fn endless_recursion_is_cut_before_the_stack_overflows() {
    let source = hostile("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}");
    // On a 2 MiB thread, the size of a Tokio worker's stack.
    let outcome = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            let t = ChatTemplate::new(source).unwrap();
            let started = Instant::now();
            let result = render(&t, &go());
            (result, started, render(&t, &hi()))
        })
        .unwrap()
        .join()
        .unwrap();
    assert_limit(outcome.0, "recursion", outcome.1);
    assert_eq!(outcome.2.unwrap(), "<user>hi");
    // Recursion below the limit is fine (HF templates recurse over nested JSON schemas).
    let t = ChatTemplate::new(hostile(
        "{% macro r(n) %}{% if n < 60 %}{{ r(n + 1) }}{% else %}deep{% endif %}{% endmacro %}{{ r(0) }}",
    ))
    .unwrap();
    assert_eq!(render(&t, &go()).unwrap(), "deep");
}

#[test]
fn gigabytes_of_output_hit_the_output_limit() {
    let started = Instant::now();
    // Literal text in a loop: 10^10 × 64 bytes.
    let t = ChatTemplate::new(hostile(&format!(
        "{{% for a in range(100000) %}}{{% for b in range(100000) %}}{}{{% endfor %}}{{% endfor %}}",
        "x".repeat(64)
    )))
    .unwrap()
    .with_render_limits(RenderLimits::default().with_max_output_bytes(1 << 20))
    .unwrap();
    assert_limit(render(&t, &go()), "output size", started);
    // Big expressions: 100 × 50 MB.
    let t = ChatTemplate::new(hostile(
        "{% for i in range(100) %}{{ 'y' * 50000000 }}{% endfor %}",
    ))
    .unwrap();
    let started = Instant::now();
    let result = render(&t, &go());
    assert_limit(result, "output size", started);
    let message = render(&t, &go()).unwrap_err().to_string();
    assert!(message.contains("more than 67108864 bytes"), "{message}");
    assert_eq!(render(&t, &hi()).unwrap(), "<user>hi");
}
