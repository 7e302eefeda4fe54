//! `pipeline serve`: a pipeline's tables and models over Arrow Flight SQL.
//!
//! Any Flight SQL client (ADBC, JDBC, `pyarrow.flight`) runs read-only SQL over the declared
//! tables, each at its latest committed version, with the served models as SQL functions:
//! `SELECT id, predict(text), predict_score(text) FROM reviews`. Spark's `mapInArrow` streams
//! batches through DoExchange and gets them back with predictions appended. Both paths feed
//! the same [`crate::predict::Engine`] as the batch `predict` stage, so results match it.
//!
//! Layout: `plan` validates the `serve:` section, `auth` checks callers, `scorer` wraps a
//! model, `udf` turns it into SQL functions, `lake` makes each query's session, `flight`
//! and `exchange` speak the protocol.

mod auth;
mod exchange;
mod flight;
mod lake;
mod plan;
mod scorer;
mod udf;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

pub use auth::hash_password;
use plan::ServeConfig;

use crate::error::{Error, Result};
use crate::plan::Pipeline;

/// Largest gRPC message accepted or sent (a DoExchange batch from Spark can be large).
const MAX_MESSAGE: usize = 256 << 20;

/// How to serve a pipeline.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct ServeOptions {
    listen: Option<String>,
}

impl ServeOptions {
    pub fn new() -> Self {
        Self::default()
    }
    /// Listen here instead of the file's `serve.listen` (`host:port`; port 0 picks one).
    pub fn with_listen(mut self, listen: Option<String>) -> Self {
        self.listen = listen;
        self
    }
}

/// Checks a pipeline's `serve:` section as `pipeline serve` would before binding.
pub(crate) fn check(pipeline: &Pipeline) -> Result<()> {
    let config =
        ServeConfig::from_pipeline(pipeline, None).map_err(|m| Error::config(&pipeline.file, m))?;
    check_users(pipeline, &config)
}

/// Every table a users file names must be declared.
fn check_users(pipeline: &Pipeline, config: &ServeConfig) -> Result<()> {
    let Some(auth) = &config.auth else {
        return Ok(());
    };
    let declared: BTreeSet<&str> = pipeline.tables.keys().map(String::as_str).collect();
    let unknown = auth.unknown_tables(&declared);
    if unknown.is_empty() {
        return Ok(());
    }
    Err(Error::config(
        &pipeline.file,
        format!(
            "serve.auth.users_file: users may read tables that are not declared: {}; \
             declared: {}",
            unknown.join(", "),
            declared.iter().copied().collect::<Vec<_>>().join(", ")
        ),
    ))
}

/// The SQL functions of the `serve.models` that `sql` calls, with their models loaded, for
/// `pipeline sql`: `SELECT id FROM docs ORDER BY cosine_distance(embedding,
/// embed('query')) LIMIT 10` runs without a server. Models the query does not call are not
/// loaded; a file without `serve.models` gives none.
pub(crate) async fn query_functions(
    pipeline: &Pipeline,
    sql: &str,
) -> Result<Vec<datafusion::logical_expr::ScalarUDF>> {
    let Some(spec) = pipeline.serve.as_ref() else {
        return Ok(Vec::new());
    };
    let called = udf::called_functions(sql);
    let calls = |prefix: &str| udf::function_names(prefix).any(|name| called.contains(&name));
    // The section is checked (and models loaded) only for a query that calls a model.
    if !spec
        .models
        .keys()
        .map(String::as_str)
        .chain(["predict"])
        .any(calls)
    {
        return Ok(Vec::new());
    }
    let config =
        ServeConfig::from_pipeline(pipeline, None).map_err(|m| Error::config(&pipeline.file, m))?;
    Ok(start_models(&config, calls).await?.0)
}

/// Loads the models that have a function prefix `wanted` accepts, and returns their SQL
/// functions and the scorers by prefix (a model under two prefixes loads once).
async fn start_models(
    config: &ServeConfig,
    wanted: impl Fn(&str) -> bool,
) -> Result<(
    Vec<datafusion::logical_expr::ScalarUDF>,
    BTreeMap<String, Arc<scorer::Scorer>>,
)> {
    let mut started: BTreeMap<usize, Arc<scorer::Scorer>> = BTreeMap::new();
    let mut functions = Vec::new();
    let mut scorers = BTreeMap::new();
    for (prefix, i) in config.prefixes() {
        if !wanted(&prefix) {
            continue;
        }
        let scorer = match started.get(&i) {
            Some(s) => s.clone(),
            None => {
                let m = &config.models[i];
                let s = Arc::new(
                    scorer::Scorer::start(m)
                        .await
                        .map_err(|e| Error::Model(format!("serve.models.{}: {e}", m.name)))?,
                );
                started.insert(i, s.clone());
                s
            }
        };
        functions.extend(udf::functions(&prefix, &scorer));
        scorers.insert(prefix, scorer);
    }
    Ok((functions, scorers))
}

/// Plans `sql` in `ctx` with the served models' calls lifted out of the expressions they
/// sit in, as `pipeline serve` runs them.
pub(crate) async fn plan_query(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> Result<datafusion::prelude::DataFrame> {
    let df = ctx.sql(sql).await.map_err(|e| {
        let text = e.strip_backtrace();
        if text.contains("Invalid function")
            && (text.contains("'embed'") || text.contains("'predict"))
        {
            let hint = "`predict()` and `embed()` call a model of the file's `serve.models`, \
                        e.g.\n  serve:\n    models:\n      minilm: \
                        ~/.cache/lakeml/assets/all-MiniLM-L6-v2";
            Error::engine(
                "the query",
                datafusion::error::DataFusionError::Plan(format!("{text}; {hint}")),
            )
        } else {
            Error::engine("the query", e)
        }
    })?;
    let (state, plan) = df.into_parts();
    let plan = udf::lift_async_calls(plan).map_err(|e| Error::engine("the query", e))?;
    udf::check_async_placement(&plan).map_err(|e| Error::engine("the query", e))?;
    Ok(datafusion::prelude::DataFrame::new(state, plan))
}

impl Pipeline {
    /// Serves the pipeline's tables and models until SIGINT or SIGTERM; queries in flight
    /// then get `serve.shutdown_grace` to finish.
    pub async fn serve(&self, options: &ServeOptions) -> Result<()> {
        let mut config = ServeConfig::from_pipeline(self, options.listen.as_deref())
            .map_err(|m| Error::config(&self.file, m))?;
        check_users(self, &config)?;
        let declared: BTreeSet<&str> = self.tables.keys().map(String::as_str).collect();

        // Every model has a prefix of its own, so every model loads.
        let (functions, scorers) = start_models(&config, |_| true).await?;
        let lake = lake::Lake::open(&self.tables, functions, &config.memory).await?;
        let auth = config.auth.is_some();
        let service = flight::Service::new(
            lake,
            scorers,
            config.auth.take().map(Arc::new),
            config.max_queries,
            config.query_timeout,
        )?;

        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| Error::io(format!("listening on {}", config.listen), e))?;
        let address = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listening address", e))?;
        let mut builder = Server::builder();
        let scheme = match &config.tls {
            Some((cert, key)) => {
                builder = tls(builder, cert, key).map_err(|m| Error::config(&self.file, m))?;
                "grpc+tls"
            }
            None => "grpc",
        };
        let models: Vec<String> = config
            .models
            .iter()
            .map(|m| {
                let default = if m.default { " = predict()" } else { "" };
                format!("{}(){default}", m.name)
            })
            .collect();
        // Written once, errors ignored: a launcher that reads the address and then closes
        // the pipe must not bring the server down (println! panics on EPIPE).
        let banner = format!(
            "lakeml serve: listening on {scheme}://{address}\n  tables: {}; models: {}\n{}\n",
            declared.iter().copied().collect::<Vec<_>>().join(", "),
            models.join(", "),
            snippet(scheme, &address.to_string(), auth)
        );
        let mut stdout = std::io::stdout().lock();
        let _ = std::io::Write::write_all(&mut stdout, banner.as_bytes())
            .and_then(|()| std::io::Write::flush(&mut stdout));
        drop(stdout);

        let flight = FlightServiceServer::new(flight::Front(Arc::new(service)))
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut server = tokio::spawn(builder.add_service(flight).serve_with_incoming_shutdown(
            incoming,
            async {
                let _ = stopped.await;
            },
        ));
        tokio::select! {
            finished = &mut server => {
                return finished
                    .map_err(|e| Error::Internal(format!("the server task failed: {e}")))?
                    .map_err(|e| Error::Internal(format!("the server failed: {e}")));
            }
            signal = shutdown_signal() => {
                eprintln!(
                    "lakeml serve: {signal}: taking no new calls; queries in flight have {}s \
                     to finish",
                    config.grace.as_secs_f64()
                );
            }
        }
        let _ = stop.send(());
        match tokio::time::timeout(config.grace, &mut server).await {
            Ok(_) => eprintln!("lakeml serve: stopped"),
            Err(_) => {
                server.abort();
                eprintln!(
                    "lakeml serve: the grace period ({}s) is over; the queries still running \
                     were cancelled",
                    config.grace.as_secs_f64()
                );
            }
        }
        Ok(())
    }
}

/// Waits for SIGINT or SIGTERM; returns its name.
async fn shutdown_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            },
            _ => {
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

#[cfg(feature = "tls")]
fn tls(builder: Server, cert: &[u8], key: &[u8]) -> Result<Server, String> {
    use tonic::transport::{Identity, ServerTlsConfig};
    // Fails only when a provider is installed already, which is as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
    builder
        .tls_config(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))
        .map_err(|e| format!("serve.tls: {e}"))
}

#[cfg(not(feature = "tls"))]
fn tls(_: Server, _: &[u8], _: &[u8]) -> Result<Server, String> {
    Err(
        "serve.tls: this build of lakeml has no TLS (built without the `tls` feature); \
         rebuild with default features, or put a TLS proxy in front"
            .into(),
    )
}

/// A client snippet to paste, printed when the server is ready.
fn snippet(scheme: &str, address: &str, auth: bool) -> String {
    let login = if auth {
        r#", db_kwargs={"username": "<user>", "password": "<password>"}"#
    } else {
        ""
    };
    let encryption = if scheme == "grpc+tls" {
        "true"
    } else {
        "false"
    };
    format!(
        "  Python (pip install adbc-driver-flightsql):\n    \
         import adbc_driver_flightsql.dbapi as flight_sql\n    \
         conn = flight_sql.connect(\"{scheme}://{address}\"{login})\n    \
         conn.cursor().execute(\"SELECT predict('a fine film')\").fetchall()\n  \
         JDBC: jdbc:arrow-flight-sql://{address}?useEncryption={encryption}"
    )
}
