//! `${NAME}` and `${NAME:-default}` in pipeline files, from the environment.

/// Replaces every `${NAME}` / `${NAME:-default}`; `$$` is a literal `$`.
/// An unset variable without a default is an error naming it and its line.
pub(super) fn env_vars(text: &str) -> Result<String, String> {
    env_vars_with(text, |name| std::env::var(name).ok())
}

fn env_vars_with(text: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    for (lineno, line) in text.split_inclusive('\n').enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find('$') {
            out.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            if let Some(tail) = after.strip_prefix('$') {
                out.push('$');
                rest = tail;
            } else if let Some(body) = after.strip_prefix('{') {
                let end = body.find('}').ok_or_else(|| {
                    format!(
                        "line {}: `${{` without a closing `}}`; write `$${{` for a literal",
                        lineno + 1
                    )
                })?;
                let expr = &body[..end];
                let (name, default) = match expr.split_once(":-") {
                    Some((n, d)) => (n, Some(d)),
                    None => (expr, None),
                };
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(format!(
                        "line {}: `${{{expr}}}` is not a variable name (letters, digits, _)",
                        lineno + 1
                    ));
                }
                match (lookup(name), default) {
                    (Some(v), _) => out.push_str(&v),
                    (None, Some(d)) => out.push_str(d),
                    (None, None) => {
                        return Err(format!(
                            "line {}: environment variable `{name}` is not set; set it, or give a \
                             default as `${{{name}:-value}}`",
                            lineno + 1
                        ));
                    }
                }
                rest = &body[end + 1..];
            } else {
                out.push('$');
                rest = after;
            }
        }
        out.push_str(rest);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::env_vars_with;

    fn lookup(name: &str) -> Option<String> {
        (name == "HOME_DIR").then(|| "/h".to_string())
    }

    #[test]
    fn substitutes_set_and_default_values() {
        let got = env_vars_with("a: ${HOME_DIR}/x\nb: ${NOPE:-d}/y $$z $w", lookup).unwrap();
        assert_eq!(got, "a: /h/x\nb: d/y $z $w");
    }

    #[test]
    fn unset_variable_names_it_and_its_line() {
        let err = env_vars_with("a: 1\nb: ${NOPE}\n", lookup).unwrap_err();
        assert!(
            err.starts_with("line 2: environment variable `NOPE` is not set"),
            "{err}"
        );
    }

    #[test]
    fn unclosed_brace_is_an_error() {
        assert!(
            env_vars_with("a: ${X", lookup)
                .unwrap_err()
                .contains("closing")
        );
    }
}
