//! Who may call the server: users with argon2-hashed passwords (a handshake with HTTP Basic
//! credentials returns a Bearer token), and static Bearer tokens taken from the environment.
//! Each user may be limited to a list of tables.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use base64::Engine as _;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::config::{AuthSpec, parse_duration};

/// A caller, once authenticated.
#[derive(Debug, Clone)]
pub(crate) struct Principal {
    pub name: String,
    /// The only tables this caller may read; `None`: every declared table.
    pub tables: Option<BTreeSet<String>>,
}

impl Principal {
    pub(crate) fn anonymous() -> Self {
        Self {
            name: "anonymous".into(),
            tables: None,
        }
    }

    pub(crate) fn may_read(&self, table: &str) -> bool {
        self.tables.as_ref().is_none_or(|t| t.contains(table))
    }
}

/// The users file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsersFile {
    users: HashMap<String, UserSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UserSpec {
    /// An argon2 PHC string (`pipeline hash-password` prints one).
    password: String,
    tables: Option<Vec<String>>,
}

struct User {
    hash: String,
    tables: Option<BTreeSet<String>>,
}

struct Session {
    principal: Principal,
    expires: Instant,
}

/// Credentials the server accepts, and the tokens it has handed out.
pub(crate) struct Auth {
    users: HashMap<String, User>,
    /// sha256 of each static token.
    tokens: Vec<[u8; 32]>,
    ttl: Duration,
    sessions: Mutex<HashMap<String, Session>>,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Auth {
    /// Reads `auth:` and its users file.
    pub(crate) fn from_spec(spec: &AuthSpec, base: &Path) -> Result<Self, String> {
        let mut users = HashMap::new();
        if let Some(file) = &spec.users_file {
            let path = crate::plan::resolve(base, file);
            let text = std::fs::read_to_string(&path).map_err(|e| {
                format!(
                    "serve.auth.users_file: cannot read `{}`: {e}",
                    path.display()
                )
            })?;
            let parsed: UsersFile = serde_yaml_ng::from_str(&text)
                .map_err(|e| format!("serve.auth.users_file ({}): {e}", path.display()))?;
            for (name, u) in parsed.users {
                PasswordHash::new(&u.password).map_err(|e| {
                    format!(
                        "serve.auth.users_file ({}): user `{name}`: `password` is not an argon2 \
                         hash ({e}); store the output of `pipeline hash-password`, never the \
                         password itself",
                        path.display()
                    )
                })?;
                let tables = u.tables.map(|t| t.into_iter().collect());
                users.insert(
                    name,
                    User {
                        hash: u.password,
                        tables,
                    },
                );
            }
        }
        let mut tokens = Vec::new();
        for (i, t) in spec.tokens.iter().enumerate() {
            if t.len() < 16 {
                return Err(format!(
                    "serve.auth.tokens[{i}]: a token needs at least 16 characters (this one has \
                     {}); generate one, e.g. `openssl rand -hex 32`",
                    t.len()
                ));
            }
            tokens.push(digest(t));
        }
        if users.is_empty() && tokens.is_empty() {
            return Err(
                "serve.auth: give a `users_file` with at least one user, or `tokens`".into(),
            );
        }
        let ttl =
            parse_duration(&spec.token_ttl).map_err(|e| format!("serve.auth.token_ttl: {e}"))?;
        Ok(Self {
            users,
            tokens,
            ttl,
            sessions: Mutex::new(HashMap::new()),
        })
    }

    /// Tables named in the users file that the pipeline does not declare.
    pub(crate) fn unknown_tables<'a>(&'a self, declared: &BTreeSet<&str>) -> Vec<&'a str> {
        self.users
            .values()
            .filter_map(|u| u.tables.as_ref())
            .flatten()
            .map(String::as_str)
            .filter(|t| !declared.contains(t))
            .collect()
    }

    /// Checks HTTP Basic credentials (`authorization: Basic base64(user:password)`) and hands
    /// out a Bearer token. Verifying a password is slow on purpose: run it off the runtime.
    pub(crate) async fn login(self: &std::sync::Arc<Self>, header: &str) -> Result<String, Status> {
        let encoded = header
            .strip_prefix("Basic ")
            .ok_or_else(|| Status::unauthenticated("the handshake needs Basic credentials"))?;
        // Padding is optional: the Go Flight client (ADBC) sends none.
        let encoded = encoded.trim().trim_end_matches('=');
        let decoded = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(encoded)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .ok_or_else(|| Status::unauthenticated("malformed Basic credentials"))?;
        let (name, password) = decoded
            .split_once(':')
            .ok_or_else(|| Status::unauthenticated("malformed Basic credentials"))?;
        let (name, password) = (name.to_string(), password.to_string());
        let auth = self.clone();
        let principal = tokio::task::spawn_blocking(move || {
            let user = auth.users.get(&name)?;
            let hash = PasswordHash::new(&user.hash).ok()?;
            argon2::Argon2::default()
                .verify_password(password.as_bytes(), &hash)
                .ok()?;
            Some(Principal {
                name,
                tables: user.tables.clone(),
            })
        })
        .await
        .map_err(|e| Status::internal(format!("checking the password: {e}")))?
        .ok_or_else(|| Status::unauthenticated("wrong user name or password"))?;
        let token = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let mut sessions = self
            .sessions
            .lock()
            .map_err(|_| Status::internal("session table poisoned"))?;
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        sessions.insert(
            token.clone(),
            Session {
                principal,
                expires: now + self.ttl,
            },
        );
        Ok(token)
    }

    /// The caller of a request that carries `authorization: Bearer <token>`.
    pub(crate) fn check(&self, metadata: &MetadataMap) -> Result<Principal, Status> {
        let header = metadata
            .get("authorization")
            .ok_or_else(|| {
                Status::unauthenticated(
                    "no credentials: log in with a handshake (user and password), or send \
                     `authorization: Bearer <token>`",
                )
            })?
            .to_str()
            .map_err(|_| Status::unauthenticated("the authorization header is not text"))?;
        let token = header.strip_prefix("Bearer ").ok_or_else(|| {
            Status::unauthenticated("send `authorization: Bearer <token>` (log in first)")
        })?;
        let token = token.trim();
        let wanted = digest(token);
        if self.tokens.iter().any(|t| t == &wanted) {
            return Ok(Principal {
                name: "token".into(),
                tables: None,
            });
        }
        let sessions = self
            .sessions
            .lock()
            .map_err(|_| Status::internal("session table poisoned"))?;
        match sessions.get(token) {
            Some(s) if s.expires > Instant::now() => Ok(s.principal.clone()),
            Some(_) => Err(Status::unauthenticated(
                "the token has expired; log in again",
            )),
            None => Err(Status::unauthenticated(
                "unknown token; log in again with a handshake",
            )),
        }
    }
}

/// An argon2id hash of `password` in PHC form, for a users file.
pub fn hash_password(password: &str) -> crate::Result<String> {
    let salt = SaltString::encode_b64(uuid::Uuid::new_v4().as_bytes())
        .map_err(|e| crate::Error::Internal(format!("making a salt: {e}")))?;
    argon2::Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| crate::Error::Internal(format!("hashing the password: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hashed_password_verifies_and_a_wrong_one_does_not() {
        let hash = hash_password("s3cret").expect("hash");
        assert!(hash.starts_with("$argon2id$"), "{hash}");
        let parsed = PasswordHash::new(&hash).expect("phc");
        let argon = argon2::Argon2::default();
        assert!(argon.verify_password(b"s3cret", &parsed).is_ok());
        assert!(argon.verify_password(b"s3cret ", &parsed).is_err());
    }
}
