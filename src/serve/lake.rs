//! The tables a server exposes, and one SQL session per query over them.
//!
//! Each query sees only the declared tables its caller may read, each Delta table at its
//! latest committed version when the query is planned (time-travel tables stay pinned), and
//! the versions it saw travel in its tickets, so every endpoint of one result reads the same
//! snapshot. The session is read-only: DDL, DML, `COPY` and `SET` are refused before
//! anything runs, and no table function reads files.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use datafusion::catalog::{
    CatalogProvider, MemoryCatalogProvider, MemoryCatalogProviderList, MemorySchemaProvider,
    SchemaProvider,
};
use datafusion::common::ParamValues;
use datafusion::datasource::{MemTable, TableProvider};
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::context::SessionState;
use datafusion::logical_expr::ScalarUDF;
use datafusion::prelude::{DataFrame, SQLOptions, SessionConfig, SessionContext};
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};
use deltalake::DeltaTable;
use deltalake::delta_datafusion::planner::DeltaPlanner;

use super::auth::Principal;
use super::udf::{check_async_placement, lift_async_calls};
use crate::catalog::{TableDef, TableKind};
use crate::error::{Error, Result};

pub(crate) const CATALOG: &str = "lakeml";
pub(crate) const SCHEMA: &str = "public";

/// Table functions a query may call: they make rows, they read no files.
const SAFE_TABLE_FUNCTIONS: &[&str] = &["generate_series", "range"];

/// Providers of Delta tables at a version kept for reuse.
const PROVIDER_CACHE: usize = 64;

/// The Delta version of each table a query read.
pub(crate) type Versions = BTreeMap<String, i64>;

/// A table that follows its latest Delta version.
struct Live {
    def: TableDef,
    table: tokio::sync::Mutex<Option<DeltaTable>>,
    /// `serve.memory`: queries at the latest version read a copy in memory.
    memory: bool,
}

/// The declared tables and the session every query starts from.
pub(crate) struct Lake {
    live: BTreeMap<String, Live>,
    /// Tables that do not move: time travel, Parquet, CSV, JSON (listed at each scan).
    fixed: BTreeMap<String, Arc<dyn TableProvider>>,
    at: Mutex<HashMap<(String, i64), Arc<dyn TableProvider>>>,
    base: SessionState,
}

/// Why a query was refused, in the words a client sees.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The caller's SQL is wrong or not allowed (INVALID_ARGUMENT).
    Query(String),
    /// The server failed (INTERNAL).
    Server(Error),
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Self {
        Refusal::Server(e)
    }
}

impl Lake {
    /// Opens every declared table; `functions` are the served models' SQL functions, and
    /// the tables in `memory` are read into memory now (and again at each new version).
    pub(crate) async fn open(
        tables: &BTreeMap<String, TableDef>,
        functions: Vec<ScalarUDF>,
        memory: &BTreeSet<String>,
    ) -> Result<Self> {
        let config = SessionConfig::new()
            .with_information_schema(false)
            .with_default_catalog_and_schema(CATALOG, SCHEMA)
            .set_bool(
                "datafusion.execution.parquet.schema_force_view_types",
                false,
            )
            .set_bool("datafusion.sql_parser.map_string_types_to_utf8view", false)
            // Spread a scan of more than a batch (8192 rows) over the cores however few bytes
            // it reads: a row here may cost a model pass, and each partition becomes a Flight
            // endpoint that a client (Spark) reads in parallel. DataFusion's default leaves
            // scans under 1 MiB whole.
            .set_usize("datafusion.optimizer.repartition_file_min_size", 0)
            // Each endpoint runs its partition alone, in a plan of its own: partitions must
            // read their own file groups, not steal from a queue holding every file (with
            // stealing on, each endpoint would return the whole table).
            .set_bool(
                "datafusion.execution.enable_file_stream_work_stealing",
                false,
            );
        let state = SessionStateBuilder::new()
            .with_default_features()
            .with_config(config)
            .with_query_planner(DeltaPlanner::new())
            .build();
        let safe = state
            .table_functions()
            .iter()
            .filter(|(name, _)| SAFE_TABLE_FUNCTIONS.contains(&name.as_str()))
            .map(|(name, f)| (name.clone(), f.clone()))
            .collect::<HashMap<_, _>>();
        let state = SessionStateBuilder::new_from_existing(state)
            .with_table_functions(safe)
            .build();
        let ctx = SessionContext::new_with_state(state);
        crate::vector::register(&ctx);
        for f in functions {
            ctx.register_udf(f);
        }
        let mut live = BTreeMap::new();
        let mut fixed = BTreeMap::new();
        for (name, def) in tables {
            match &def.kind {
                TableKind::Delta { at: None } => {
                    let table = if def.delta_exists().await? {
                        let t = def.open_delta(None).await?;
                        t.update_datafusion_session(&ctx.state())
                            .map_err(|e| Error::delta(format!("table `{name}`"), e))?;
                        Some(t)
                    } else {
                        None // appears once a stage writes it
                    };
                    live.insert(
                        name.clone(),
                        Live {
                            def: def.clone(),
                            table: tokio::sync::Mutex::new(table),
                            memory: memory.contains(name),
                        },
                    );
                }
                _ => {
                    def.register(&ctx).await?;
                    let mut provider = ctx
                        .table_provider(name.as_str())
                        .await
                        .map_err(|e| Error::engine(format!("table `{name}`"), e))?;
                    if memory.contains(name) {
                        provider = in_memory(&ctx, name, provider).await?;
                    }
                    fixed.insert(name.clone(), provider);
                }
            }
        }
        let lake = Self {
            live,
            fixed,
            at: Mutex::new(HashMap::new()),
            base: ctx.state(),
        };
        for (name, live) in lake.live.iter().filter(|(_, l)| l.memory) {
            lake.provider(name, live, None).await?;
        }
        Ok(lake)
    }

    /// Declared table names.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.live
            .keys()
            .chain(self.fixed.keys())
            .map(String::as_str)
    }

    /// A session over the tables `who` may read: live tables at `pinned` versions, or at
    /// their latest; returns the versions it used.
    pub(crate) async fn session(
        &self,
        who: &Principal,
        pinned: Option<&Versions>,
    ) -> Result<(SessionContext, Versions)> {
        let schema = Arc::new(MemorySchemaProvider::new());
        let mut versions = Versions::new();
        let register = |name: &str, provider: Arc<dyn TableProvider>| {
            schema
                .register_table(name.to_string(), provider)
                .map(|_| ())
                .map_err(|e| Error::engine(format!("table `{name}`"), e))
        };
        for (name, provider) in self.fixed.iter().filter(|(n, _)| who.may_read(n)) {
            register(name, provider.clone())?;
        }
        for (name, live) in self.live.iter().filter(|(n, _)| who.may_read(n)) {
            let want = pinned.and_then(|p| p.get(name)).copied();
            if let Some((version, provider)) = self.provider(name, live, want).await? {
                versions.insert(name.clone(), version);
                register(name, provider)?;
            }
        }
        let catalog = Arc::new(MemoryCatalogProvider::new());
        catalog
            .register_schema(SCHEMA, schema)
            .map_err(|e| Error::engine("the query's catalog", e))?;
        let catalogs = Arc::new(MemoryCatalogProviderList::new());
        datafusion::catalog::CatalogProviderList::register_catalog(
            catalogs.as_ref(),
            CATALOG.to_string(),
            catalog,
        );
        let state = SessionStateBuilder::new_from_existing(self.base.clone())
            .with_catalog_list(catalogs)
            .build();
        Ok((SessionContext::new_with_state(state), versions))
    }

    /// A live table's provider at `want` (or its latest version); `None` while the table
    /// does not exist yet.
    async fn provider(
        &self,
        name: &str,
        live: &Live,
        want: Option<i64>,
    ) -> Result<Option<(i64, Arc<dyn TableProvider>)>> {
        let engine = |e| Error::engine(format!("table `{name}`"), e);
        let delta = |e| Error::delta(format!("table `{name}`"), e);
        let mut guard = live.table.lock().await;
        if guard.is_none() {
            if !live.def.delta_exists().await? {
                return Ok(None);
            }
            *guard = Some(live.def.open_delta(None).await?);
        }
        let Some(table) = guard.as_mut() else {
            return Ok(None);
        };
        let version = match want {
            Some(v) => v,
            None => {
                table.update_incremental(None).await.map_err(delta)?;
                table.version().map_or(0, |v| v as i64)
            }
        };
        if let Some(p) = self.cached(name, version) {
            return Ok(Some((version, p)));
        }
        let provider = if table.version() == u64::try_from(version).ok() {
            let provider = table.table_provider().await.map_err(engine)?;
            if live.memory {
                let copy = in_memory(
                    &SessionContext::new_with_state(self.base.clone()),
                    name,
                    provider,
                )
                .await?;
                // One copy per table: the older versions' copies go (a ticket from before
                // the new commit reads its version from storage).
                if let Ok(mut at) = self.at.lock() {
                    at.retain(|(n, _), _| n != name);
                }
                copy
            } else {
                provider
            }
        } else {
            // A ticket from before the latest commit: that exact version, loaded apart.
            let mut old = live.def.open_delta(None).await?;
            old.load_version(u64::try_from(version).unwrap_or(0))
                .await
                .map_err(delta)?;
            old.table_provider().await.map_err(engine)?
        };
        if let Ok(mut at) = self.at.lock() {
            if at.len() >= PROVIDER_CACHE {
                // Keep the in-memory copies: they are costly to make again.
                at.retain(|(n, _), _| self.live.get(n).is_some_and(|l| l.memory));
            }
            at.insert((name.to_string(), version), provider.clone());
        }
        Ok(Some((version, provider)))
    }

    fn cached(&self, name: &str, version: i64) -> Option<Arc<dyn TableProvider>> {
        self.at
            .lock()
            .ok()?
            .get(&(name.to_string(), version))
            .cloned()
    }
}

/// `provider`'s rows read into memory, in as many partitions as the session has cores, so
/// a scan of them runs at memory speed on every core.
async fn in_memory(
    ctx: &SessionContext,
    name: &str,
    provider: Arc<dyn TableProvider>,
) -> Result<Arc<dyn TableProvider>> {
    let engine = |e| {
        Error::engine(
            format!("reading table `{name}` into memory (serve.memory)"),
            e,
        )
    };
    let started = std::time::Instant::now();
    let schema = provider.schema();
    let batches = ctx
        .read_table(provider)
        .map_err(engine)?
        .collect()
        .await
        .map_err(engine)?;
    let parts = ctx.state().config().target_partitions().max(1);
    let mut partitions = vec![Vec::new(); parts];
    let (rows, bytes) = batches.iter().fold((0, 0), |(r, b), x| {
        (r + x.num_rows(), b + x.get_array_memory_size())
    });
    // Whole batches, dealt by rows so each partition holds about the same number.
    let mut filled = vec![0usize; parts];
    for batch in batches {
        let i = (0..parts).min_by_key(|&i| filled[i]).unwrap_or(0);
        filled[i] += batch.num_rows();
        partitions[i].push(batch);
    }
    let table = MemTable::try_new(schema, partitions).map_err(engine)?;
    eprintln!(
        "lakeml serve: table `{name}` in memory: {rows} rows, {:.1} MiB, in {:.1}s",
        bytes as f64 / (1024.0 * 1024.0),
        started.elapsed().as_secs_f64()
    );
    Ok(Arc::new(table))
}

/// Plans `sql` in `ctx` as a read-only query with `params` bound to its `?` / `$n`
/// placeholders.
pub(crate) async fn plan(
    ctx: &SessionContext,
    who: &Principal,
    sql: &str,
    params: Option<ParamValues>,
) -> Result<DataFrame, Refusal> {
    let sql = positional_placeholders(sql);
    let options = SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false);
    let df = ctx.sql_with_options(&sql, options).await.map_err(|e| {
        let text = e.strip_backtrace();
        if text.contains("not supported")
            && (text.contains("DDL") || text.contains("DML") || text.contains("Statement"))
        {
            Refusal::Query(format!(
                "lakeml serve is read-only: {text}; only queries run here (SELECT, WITH, \
                 VALUES, EXPLAIN); tables are written by `pipeline run`"
            ))
        } else if text.contains("table") && text.contains("not found") {
            Refusal::Query(format!(
                "{text}; user `{}` can read: {}",
                who.name,
                readable(ctx)
            ))
        } else {
            Refusal::Query(text)
        }
    })?;
    let (state, plan) = df.into_parts();
    let plan = lift_async_calls(plan).map_err(|e| Refusal::Query(e.strip_backtrace()))?;
    check_async_placement(&plan).map_err(|e| Refusal::Query(e.strip_backtrace()))?;
    let df = DataFrame::new(state, plan);
    match params {
        Some(p) => df.with_param_values(p).map_err(|e| {
            Refusal::Query(format!("binding the parameters: {}", e.strip_backtrace()))
        }),
        None => Ok(df),
    }
}

/// The tables registered in `ctx`, for messages.
fn readable(ctx: &SessionContext) -> String {
    let names = ctx
        .catalog(CATALOG)
        .and_then(|c| c.schema(SCHEMA))
        .map(|s| s.table_names())
        .unwrap_or_default();
    let mut names = names;
    names.sort();
    names.join(", ")
}

/// ODBC/JDBC-style `?` placeholders become DataFusion's `$1`, `$2`, ... (only outside
/// strings, identifiers and comments, which the SQL tokenizer tells apart).
pub(crate) fn positional_placeholders(sql: &str) -> String {
    let Ok(tokens) = Tokenizer::new(&GenericDialect {}, sql).tokenize() else {
        return sql.to_string();
    };
    if !tokens
        .iter()
        .any(|t| matches!(t, Token::Placeholder(p) if p == "?"))
    {
        return sql.to_string();
    }
    let mut n = 0;
    tokens
        .into_iter()
        .map(|t| match t {
            Token::Placeholder(p) if p == "?" => {
                n += 1;
                format!("${n}")
            }
            other => other.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::positional_placeholders;

    #[test]
    fn question_marks_become_numbered_placeholders_outside_strings() {
        assert_eq!(
            positional_placeholders("SELECT a FROM t WHERE id = ? AND s = '?' AND b > ?"),
            "SELECT a FROM t WHERE id = $1 AND s = '?' AND b > $2"
        );
        let plain = "SELECT 'it''s' AS x -- why?\n";
        assert_eq!(positional_placeholders(plain), plain);
    }
}
