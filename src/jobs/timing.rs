//! When time triggers fire: catch-up after downtime and retry back-off over the ticks of
//! [`Timing`] (parsed in `plan::jobs`). Pure functions of the times given, so tests run
//! against any clock.
//!
//! DST, as croner implements it (Vixie cron): a fixed time that a spring-forward skips runs
//! at the first valid minute after the gap, the same day; a fixed time in a repeated
//! fall-back hour runs once, at its first occurrence. Patterns with `*` or steps in the
//! minute or hour field follow real time through both passes of a repeated hour.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::config::Catchup;
pub(crate) use crate::plan::{Timing, human};

/// Most ticks looked at in one catch-up (a 1-second interval over 10 days).
const MAX_SCAN: usize = 1_000_000;

/// What to do with the ticks that came due since the last one handled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Due {
    /// Ticks to run now, oldest first.
    pub run: Vec<DateTime<Utc>>,
    /// Ticks passed over (missed while down, beyond the catch-up policy).
    pub skipped: usize,
    /// The newest tick due; the next call starts after it.
    pub cursor: DateTime<Utc>,
}

/// The ticks in `(cursor, now]` and which of them run under `catchup`.
///
/// A tick at most `on_time` old is on time (the scheduler was up and polling); older ones
/// were missed. On-time ticks always run. Of the missed ones, `none` runs nothing, `latest`
/// runs the newest once (unless an on-time tick already runs), and `all` runs the newest
/// `max_catchup` in order.
pub(crate) fn due(
    timing: &Timing,
    cursor: DateTime<Utc>,
    now: DateTime<Utc>,
    catchup: Catchup,
    max_catchup: usize,
    on_time: Duration,
) -> Due {
    let on_time = TimeDelta::from_std(on_time).unwrap_or(TimeDelta::MAX);
    let mut missed = std::collections::VecDeque::new();
    let mut punctual = Vec::new();
    let mut total = 0usize;
    let mut at = cursor;
    let mut newest = cursor;
    while total < MAX_SCAN {
        let Some(tick) = timing.next_after(at).filter(|t| *t <= now) else {
            break;
        };
        total += 1;
        newest = tick;
        at = tick;
        if now - tick <= on_time {
            punctual.push(tick);
        } else {
            missed.push_back(tick);
            // Only the newest few can ever run.
            if missed.len() > max_catchup.max(1) {
                missed.pop_front();
            }
        }
    }
    let missed_total = total - punctual.len();
    let caught: Vec<DateTime<Utc>> = match catchup {
        Catchup::None => Vec::new(),
        Catchup::Latest if punctual.is_empty() => missed.back().copied().into_iter().collect(),
        Catchup::Latest => Vec::new(),
        Catchup::All => missed.iter().copied().collect(),
    };
    let skipped = missed_total - caught.len();
    let mut run = caught;
    run.extend(punctual);
    Due {
        run,
        skipped,
        cursor: newest,
    }
}

/// The delay before retry `retry` (1 for the first): `backoff · 2^(retry−1)`, capped at
/// `cap`, then scaled by `0.8 + 0.2·jitter` (`jitter` in `[0, 1)`) so that jobs failing
/// together do not retry in lockstep.
pub(crate) fn backoff(base: Duration, cap: Duration, retry: u32, jitter: f64) -> Duration {
    let doubling = 2u32.saturating_pow(retry.saturating_sub(1));
    let delay = base.saturating_mul(doubling).min(cap);
    delay.mul_f64(0.8 + 0.2 * jitter.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono_tz::Tz;

    fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .expect("rfc3339")
            .with_timezone(&Utc)
    }

    fn berlin(text: &str) -> Timing {
        Timing::cron(text, chrono_tz::Europe::Berlin).expect("valid cron")
    }

    const ON_TIME: Duration = Duration::from_secs(60);

    #[test]
    fn a_time_skipped_by_spring_forward_runs_at_the_next_valid_time() {
        // Berlin, 2026-03-29: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
        let daily = berlin("30 2 * * *");
        let ticks = daily.upcoming(utc("2026-03-27T12:00:00Z"), 4);
        assert_eq!(
            ticks,
            vec![
                utc("2026-03-28T01:30:00Z"), // 02:30 CET
                utc("2026-03-29T01:00:00Z"), // 02:30 does not exist: 03:00 CEST
                utc("2026-03-30T00:30:00Z"), // 02:30 CEST
                utc("2026-03-31T00:30:00Z"),
            ]
        );
    }

    #[test]
    fn a_repeated_fall_back_hour_runs_a_fixed_time_once() {
        // Berlin, 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 happens twice.
        let daily = berlin("30 2 * * *");
        let ticks = daily.upcoming(utc("2026-10-24T12:00:00Z"), 3);
        assert_eq!(
            ticks,
            vec![
                utc("2026-10-25T00:30:00Z"), // 02:30 CEST, the first pass only
                utc("2026-10-26T01:30:00Z"), // 02:30 CET
                utc("2026-10-27T01:30:00Z"),
            ]
        );
        // The due ticks over that night, as the scheduler sees them minute by minute: once.
        let mut cursor = utc("2026-10-24T23:00:00Z");
        let mut runs = Vec::new();
        let mut now = cursor;
        while now < utc("2026-10-25T03:00:00Z") {
            now += TimeDelta::seconds(30);
            let d = due(&daily, cursor, now, Catchup::Latest, 10, ON_TIME);
            runs.extend(d.run);
            cursor = d.cursor;
        }
        assert_eq!(runs, vec![utc("2026-10-25T00:30:00Z")]);
    }

    #[test]
    fn an_interval_pattern_follows_real_time_through_the_repeated_hour() {
        // `0 * * * *` in Berlin on fall-back night: 02:00 CEST and 02:00 CET are an hour
        // apart in real time, and both run; no hour runs twice in UTC.
        let hourly = berlin("0 * * * *");
        let ticks = hourly.upcoming(utc("2026-10-24T23:30:00Z"), 4);
        assert_eq!(
            ticks,
            vec![
                utc("2026-10-25T00:00:00Z"), // 02:00 CEST
                utc("2026-10-25T01:00:00Z"), // 02:00 CET
                utc("2026-10-25T02:00:00Z"), // 03:00 CET
                utc("2026-10-25T03:00:00Z"),
            ]
        );
    }

    #[test]
    fn the_weekly_retrain_runs_on_sunday_night_in_berlin_time() {
        let weekly = berlin("0 3 * * SUN");
        let ticks = weekly.upcoming(utc("2026-03-25T00:00:00Z"), 2);
        // 2026-03-29 is spring-forward Sunday: 03:00 CEST is 01:00 UTC; a week before, CET.
        assert_eq!(
            ticks,
            vec![utc("2026-03-29T01:00:00Z"), utc("2026-04-05T01:00:00Z")]
        );
    }

    #[test]
    fn intervals_tick_on_multiples_since_the_epoch() {
        let every = Timing::Every(Duration::from_secs(600));
        assert_eq!(
            every.upcoming(utc("2026-11-24T08:03:12Z"), 2),
            vec![utc("2026-11-24T08:10:00Z"), utc("2026-11-24T08:20:00Z")]
        );
        assert_eq!(
            every.next_after(utc("2026-11-24T08:10:00Z")),
            Some(utc("2026-11-24T08:20:00Z"))
        );
    }

    #[test]
    fn three_days_down_under_each_catchup_policy() {
        let hourly = Timing::Every(Duration::from_secs(3600));
        let last = utc("2026-11-20T10:00:00Z");
        let back = utc("2026-11-23T10:20:00Z"); // 72 ticks missed, the newest 20 min ago
        let none = due(&hourly, last, back, Catchup::None, 10, ON_TIME);
        assert!(none.run.is_empty());
        assert_eq!(none.skipped, 72);
        assert_eq!(none.cursor, utc("2026-11-23T10:00:00Z"));

        let latest = due(&hourly, last, back, Catchup::Latest, 10, ON_TIME);
        assert_eq!(latest.run, vec![utc("2026-11-23T10:00:00Z")]);
        assert_eq!(latest.skipped, 71);

        let all = due(&hourly, last, back, Catchup::All, 5, ON_TIME);
        assert_eq!(
            all.run,
            (0..5)
                .rev()
                .map(|h| utc("2026-11-23T10:00:00Z") - TimeDelta::hours(h))
                .collect::<Vec<_>>()
        );
        assert_eq!(all.skipped, 67);

        // Run again with the new cursor: nothing is due twice.
        let again = due(&hourly, all.cursor, back, Catchup::All, 5, ON_TIME);
        assert_eq!((again.run.len(), again.skipped), (0, 0));
    }

    #[test]
    fn an_on_time_tick_runs_under_every_policy() {
        let hourly = Timing::Every(Duration::from_secs(3600));
        let now = utc("2026-11-23T10:00:20Z");
        for catchup in [Catchup::None, Catchup::Latest, Catchup::All] {
            let d = due(
                &hourly,
                utc("2026-11-23T09:00:00Z"),
                now,
                catchup,
                10,
                ON_TIME,
            );
            assert_eq!(d.run, vec![utc("2026-11-23T10:00:00Z")], "{catchup:?}");
            assert_eq!(d.skipped, 0);
        }
        // Down across several ticks but back just after one: `latest` runs that one only.
        let d = due(
            &hourly,
            utc("2026-11-23T06:00:00Z"),
            now,
            Catchup::Latest,
            10,
            ON_TIME,
        );
        assert_eq!((d.run, d.skipped), (vec![utc("2026-11-23T10:00:00Z")], 3));
    }

    #[test]
    fn a_changed_cron_does_not_rerun_a_tick_already_run() {
        // Sunday 03:00 Berlin ran (the cursor); at 03:10 the cron is changed to 02:30.
        let ran = utc("2026-11-22T02:00:00Z");
        let now = utc("2026-11-22T02:10:00Z");
        let changed = berlin("30 2 * * SUN");
        let d = due(&changed, ran, now, Catchup::All, 10, ON_TIME);
        assert_eq!((d.run.len(), d.skipped), (0, 0));
        // Its first tick is next Sunday's 02:30.
        assert_eq!(
            changed.next_after(d.cursor.max(ran)),
            Some(utc("2026-11-29T01:30:00Z"))
        );
    }

    #[test]
    fn bad_patterns_are_refused_with_the_reason() {
        let bad = |t: &str| Timing::cron(t, Tz::UTC).expect_err(t);
        assert!(bad("0 3 * *").contains("has 4 fields"));
        assert!(bad("0 0 3 * * SUN").contains("has 6 fields"));
        assert!(bad("61 3 * * *").contains("not a valid cron"));
        assert!(bad("0 3 * * FUNDAY").contains("not a valid cron"));
        assert!(bad("0 0 30 2 *").contains("never matches"));
    }

    #[test]
    fn back_off_doubles_up_to_the_cap_with_bounded_jitter() {
        let base = Duration::from_secs(30);
        let cap = Duration::from_secs(300);
        assert_eq!(backoff(base, cap, 1, 1.0), Duration::from_secs(30));
        assert_eq!(backoff(base, cap, 2, 1.0), Duration::from_secs(60));
        assert_eq!(backoff(base, cap, 3, 1.0), Duration::from_secs(120));
        assert_eq!(backoff(base, cap, 5, 1.0), cap);
        assert_eq!(backoff(base, cap, 40, 1.0), cap);
        assert_eq!(backoff(base, cap, 1, 0.0), Duration::from_secs(24));
        assert_eq!(human(Duration::from_secs(90)), "1m30s");
        assert_eq!(human(Duration::from_millis(250)), "250ms");
    }
}
