//! The engine on a real model: the 0.5B Qwen2.5-Coder that `tandem model pull
//! qwen2.5-coder-0.5b` fetches, found in `TANDEM_MODELS_DIR` or the cache. Without it these
//! tests fail and say how to get it: they are never skipped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tandem_model_embedded::{Embedded, EmbeddedConfig, Event, Finish, Generate};

fn model_path() -> PathBuf {
    let dir = std::env::var_os("TANDEM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/tandem/models")
        });
    let path = dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        path.is_file(),
        "the test model is not at {}: run `cargo run -p tandem-cli -- model pull qwen2.5-coder-0.5b` (scripts/fetch-test-model.sh)",
        path.display()
    );
    path
}

fn config() -> EmbeddedConfig {
    EmbeddedConfig {
        context_tokens: 2048,
        ..EmbeddedConfig::for_cores(2)
    }
}

/// One engine for the tests that do not need their own.
fn shared() -> Arc<Embedded> {
    static ENGINE: OnceLock<Arc<Embedded>> = OnceLock::new();
    ENGINE
        .get_or_init(|| Embedded::load(&model_path(), config()).unwrap())
        .clone()
}

fn chat(user: &str) -> Vec<(String, String)> {
    vec![
        ("system".into(), "You are a terse assistant.".into()),
        ("user".into(), user.into()),
    ]
}

fn request(user: &str) -> Generate {
    Generate {
        messages: chat(user),
        max_tokens: 40,
        temperature: 0.0,
        seed: 1,
        stop: vec![],
    }
}

/// How a reply ended, if it ended with `Done`.
fn finish(event: &Event) -> Option<Finish> {
    match event {
        Event::Done { finish, .. } => Some(*finish),
        _ => None,
    }
}

/// The reply's text and its `Done` event.
async fn collect(engine: &Embedded, request: Generate) -> (String, Event) {
    let mut reply = engine.generate(request).unwrap();
    let mut text = String::new();
    while let Some(event) = reply.events.recv().await {
        match event {
            Event::Text(t) => text.push_str(&t),
            done => return (text, done),
        }
    }
    panic!("the reply ended without Done");
}

#[tokio::test]
async fn the_template_from_the_gguf_renders_chatml_ending_at_the_reply() {
    let prompt = shared().render(&chat("hi")).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[tokio::test]
async fn max_tokens_and_stop_strings_end_the_reply() {
    let engine = shared();
    let (text, done) = collect(
        &engine,
        Generate {
            max_tokens: 5,
            ..request("Count from 1 to 50, separated by spaces.")
        },
    )
    .await;
    assert!(
        matches!(
            done,
            Event::Done {
                finish: Finish::Length,
                completion_tokens: 5,
                ..
            }
        ),
        "{done:?}"
    );
    assert!(!text.is_empty());
    let (text, done) = collect(
        &engine,
        Generate {
            stop: vec!["5".into()],
            ..request("Count from 1 to 50, separated by spaces.")
        },
    )
    .await;
    assert_eq!(finish(&done), Some(Finish::Stop), "{done:?}");
    assert!(text.contains('4') && !text.contains('5'), "{text:?}");
}

#[tokio::test]
async fn a_fixed_seed_gives_the_same_reply_and_the_cache_does_not_change_it() {
    let sampled = |seed| Generate {
        temperature: 0.9,
        seed,
        max_tokens: 24,
        ..request("Write a one-line Python hello world.")
    };
    let fresh = Embedded::load(&model_path(), config()).unwrap();
    let (first, _) = collect(&fresh, sampled(7)).await;
    // Again on the same engine: the prompt now comes from its cache.
    let (again, done) = collect(&fresh, sampled(7)).await;
    assert_eq!(first, again);
    assert!(
        matches!(done, Event::Done { cached_tokens, prompt_tokens, .. } if cached_tokens + 1 == prompt_tokens),
        "{done:?}"
    );
    let other = Embedded::load(&model_path(), config()).unwrap();
    let (elsewhere, _) = collect(&other, sampled(7)).await;
    assert_eq!(first, elsewhere);
}

#[tokio::test]
async fn a_dropped_reply_stops_and_the_next_request_is_served() {
    let engine = Embedded::load(&model_path(), config()).unwrap();
    let mut reply = engine
        .generate(Generate {
            max_tokens: 500,
            ..request("Write a long story.")
        })
        .unwrap();
    assert!(matches!(reply.events.recv().await, Some(Event::Text(_))));
    drop(reply);
    let (text, done) = collect(&engine, request("Say OK.")).await;
    assert_eq!(finish(&done), Some(Finish::Stop), "{done:?}");
    assert!(!text.is_empty());
}

#[tokio::test]
async fn a_conversation_over_the_window_is_refused_with_what_to_do() {
    let engine = shared();
    let (_, done) = collect(&engine, request(&"word ".repeat(3000))).await;
    match done {
        Event::Failed(why) => assert!(
            why.contains("over the model's context window of 2048")
                && why.contains("context_tokens"),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_missing_file_says_how_to_get_one() {
    let e = Embedded::load(std::path::Path::new("/nonexistent/m.gguf"), config()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "no model file at /nonexistent/m.gguf; `tandem model pull` downloads one"
    );
}
