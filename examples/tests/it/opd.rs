//! On-policy distillation across crates: a teacher served by the embedded engine over SGLang's
//! `/generate` scoring protocol (as `miles serve` serves it) scores rollout samples through
//! miles-rollout's `OpdTeacher` (routed by `--opd-teacher-urls`), and the trainer's OPD term
//! from those log-probs equals the one from the same teacher held locally (`--opd-type
//! megatron`); both equal Miles' formula computed here from the trainer's own scoring function.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::{CausalLm, score_log_probs};
use miles_core::{PolicyTrainer, Reward, Sample};
use miles_engine::serve::{ServeOptions, server_info};
use miles_engine::{EmbeddedEngine, TrainerScorer};
use miles_examples::fixture_path;
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_rollout::opd::{OpdTeacher, OpdTeacherConfig, TopKStrategy, parse_teacher_urls};
use miles_session::sglang::sglang_router;
use miles_train::{Actor, OpdConfig, OpdType, TrainConfig};

fn score(model: &CausalLm, s: &Sample) -> Vec<f32> {
    score_log_probs(
        model,
        &s.tokens,
        s.response_length,
        &Fallthrough,
        &Default::default(),
    )
    .unwrap()
}

fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-5 * b.abs().max(1.0),
        "{what}: {a} vs {b}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_and_local_teachers_give_the_same_opd_term() {
    let dir = fixture_path("serve/qwen3-tiny-chat").unwrap();
    let teacher_lm = CausalLm::from_pretrained(&dir, &Device::flex()).unwrap();
    let engine = EmbeddedEngine::builder(teacher_lm.clone())
        .scorer(Arc::new(TrainerScorer::default()))
        .build()
        .unwrap();
    let info = server_info(&ServeOptions::new(&dir)).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/generate", listener.local_addr().unwrap());
    let app = sglang_router(Arc::new(engine), info);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    // The student: the same architecture with other weights.
    let student = CausalLm::init(&teacher_lm.config, &Device::flex().autodiff()).unwrap();
    let vocab = teacher_lm.config.vocab_size as u32;
    let mut samples: Vec<Sample> = (0..4u32)
        .map(|i| {
            let tokens: Vec<u32> = (0..9 + i).map(|t| (t * 37 + i * 11 + 5) % vocab).collect();
            let mut s = Sample {
                response_length: 4 + i as usize,
                tokens,
                reward: Some(Reward::Scalar(1.0)),
                group_index: Some(0),
                index: Some(u64::from(i)),
                loss_mask: Some((0..4 + i).map(|t| u8::from(t != 1)).collect()),
                ..Sample::default()
            };
            if i % 2 == 0 {
                s.metadata.insert("opd_teacher".into(), "math".into());
            }
            s
        })
        .collect();

    // Rollout side (--opd-type sglang): every sample routed to a teacher and scored.
    let teacher = OpdTeacher::new(OpdTeacherConfig {
        teacher_urls: parse_teacher_urls(&[format!("math={url}"), format!("default={url}")])
            .unwrap(),
        ..OpdTeacherConfig::default()
    });
    teacher.score_all(&mut samples).await;
    for s in &samples {
        let got: Vec<f32> = s
            .teacher_log_probs
            .as_ref()
            .expect("scored")
            .iter()
            .map(|&v| v as f32)
            .collect();
        assert_eq!(
            got,
            score(&teacher_lm, s),
            "the teacher scores as the trainer would"
        );
    }
    // Top-k with the teacher's tokens scored under the student at the same server: student
    // and teacher agree, so the estimate is 0 at every position.
    let topk = OpdTeacher::new(OpdTeacherConfig {
        top_k: 3,
        strategy: TopKStrategy::OnlyTeacher,
        rm_url: Some(url.clone()),
        student_url: Some(url.clone()),
        ..OpdTeacherConfig::default()
    });
    let mut same = samples[0].clone();
    topk.score(&mut same).await.unwrap();
    assert_eq!(
        same.opd_reverse_kl.unwrap(),
        vec![0.0; same.response_length]
    );

    // Miles' term: per sample the masked mean of (old student − teacher), averaged.
    let coef = 0.5;
    let student_lm = student.valid();
    let expected: f64 = samples
        .iter()
        .map(|s| {
            let old = score(&student_lm, s);
            let t = score(&teacher_lm, s);
            let mask = s.loss_mask.as_ref().unwrap();
            let sum: f64 = (0..old.len())
                .map(|k| f64::from((old[k] - t[k]) * f32::from(mask[k])))
                .sum();
            sum / mask.iter().map(|&m| f64::from(m)).sum::<f64>()
        })
        .sum::<f64>()
        / samples.len() as f64;
    let config = |opd_type| TrainConfig {
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(4),
        opd: OpdConfig {
            use_opd: true,
            opd_type,
            opd_kl_coef: coef,
            opd_teacher_load: (opd_type == OpdType::Megatron).then(|| dir.clone()),
        },
        ..TrainConfig::default()
    };
    let mut served = Actor::new(student.clone(), config(OpdType::Sglang)).unwrap();
    let from_server = served.train(0, &samples).unwrap();
    let mut local = Actor::new(student.clone(), config(OpdType::Megatron))
        .unwrap()
        .with_teacher(teacher_lm.clone())
        .unwrap();
    let bare: Vec<Sample> = samples
        .iter()
        .map(|s| Sample {
            teacher_log_probs: None,
            ..s.clone()
        })
        .collect();
    let from_local = local.train(0, &bare).unwrap();
    for m in [&from_server, &from_local] {
        close(m["train/opd_reverse_kl"], expected, "train/opd_reverse_kl");
        close(
            m["rollout/opd_reverse_kl"],
            expected,
            "rollout/opd_reverse_kl",
        );
        // Equal rewards: GRPO's advantages are 0, OPD's term is all there is, and at ratio 1
        // the policy-gradient loss is coef × the reverse KL.
        close(m["train/pg_loss"], coef * expected, "train/pg_loss");
    }
    close(
        from_server["rollout/teacher_log_probs"],
        from_local["rollout/teacher_log_probs"],
        "rollout/teacher_log_probs",
    );
    // Without teacher log-probs the sglang mode cannot train.
    let mut missing = Actor::new(student, config(OpdType::Sglang)).unwrap();
    assert!(missing.train(0, &bare).is_err());
}
