//! The wire facts of a `.proto` file: every field's message, name, number, label and type, and
//! every RPC's request and response, one line each, sorted. Enough to compare two agents'
//! protocols (flat messages, `oneof`, `map`, `repeated`, `optional`; no nesting or enums,
//! which neither agent's file has).

/// The facts of `text`, sorted: `field <Message>.<name> <number> <label> <type>` (label
/// `optional`, `repeated`, `oneof:<name>` or `-`) and `rpc <Name> <Request> <stream|unary>
/// <Response>`.
pub fn wire_facts(text: &str) -> Vec<String> {
    let mut facts = Vec::new();
    let mut message: Option<String> = None;
    let mut oneof: Option<String> = None;
    for raw in text.lines() {
        let line = raw.split("//").next().unwrap_or("").trim();
        if line.is_empty() || line.starts_with('*') || line.starts_with("/*") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("rpc ") {
            if let Some(rpc) = rpc_fact(rest) {
                facts.push(rpc);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("message ") {
            let name = rest.split('{').next().unwrap_or(rest).trim();
            message = (!line.ends_with("{}")).then(|| name.to_owned());
            // `message X { int32 a = 1; }` on one line.
            if let (Some(open), true) = (rest.find('{'), line.ends_with('}')) {
                let inner = rest[open + 1..].trim_end_matches('}');
                for decl in inner.split(';') {
                    if let Some(f) = field_fact(name, decl, None) {
                        facts.push(f);
                    }
                }
                message = None;
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("oneof ") {
            oneof = Some(rest.trim_end_matches(['{', ' ']).trim().to_owned());
            continue;
        }
        if line == "}" {
            if oneof.take().is_none() {
                message = None;
            }
            continue;
        }
        if let Some(m) = &message
            && let Some(f) = field_fact(m, line, oneof.as_deref())
        {
            facts.push(f);
        }
    }
    facts.sort();
    facts
}

fn field_fact(message: &str, decl: &str, oneof: Option<&str>) -> Option<String> {
    let (left, number) = decl.trim().trim_end_matches(';').split_once('=')?;
    let number: u32 = number
        .trim()
        .trim_end_matches(']')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let words: Vec<&str> = left.split_whitespace().collect();
    let (label, ty, name) = match words.as_slice() {
        [label @ ("optional" | "repeated"), ty, name] => ((*label).to_owned(), *ty, *name),
        [ty, name] => (
            oneof.map_or("-".to_owned(), |o| format!("oneof:{o}")),
            *ty,
            *name,
        ),
        // `map<string, string> env`: the type's words are split at the comma.
        [head @ .., name] if head.first().is_some_and(|h| h.starts_with("map<")) => {
            return Some(format!(
                "field {message}.{name} {number} - {}",
                head.join("")
            ));
        }
        _ => return None,
    };
    Some(format!("field {message}.{name} {number} {label} {ty}"))
}

fn rpc_fact(rest: &str) -> Option<String> {
    let (name, rest) = rest.split_once('(')?;
    let (request, rest) = rest.split_once(')')?;
    let response = rest.split_once("returns")?.1;
    let response = response.trim().trim_start_matches('(');
    let (response, _) = response.split_once(')')?;
    let (kind, response) = match response.trim().strip_prefix("stream ") {
        Some(r) => ("stream", r.trim()),
        None => ("unary", response.trim()),
    };
    Some(format!(
        "rpc {} {} {kind} {response}",
        name.trim(),
        request.trim()
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn fields_oneofs_maps_and_rpcs_are_read() {
        let facts = super::wire_facts(
            "service S {\n  rpc Up(UpRequest) returns (stream UpStream) {}\n}\n\
             message Empty {}\nmessage One { repeated string a = 1; }\n\
             message M {\n  optional int32 n = 1; // note\n  map<string, string> env = 2;\n  \
             oneof response {\n    Event event = 3;\n  }\n  string s = 4;\n}\n",
        );
        assert_eq!(
            facts,
            [
                "field M.env 2 - map<string,string>",
                "field M.event 3 oneof:response Event",
                "field M.n 1 optional int32",
                "field M.s 4 - string",
                "field One.a 1 repeated string",
                "rpc Up UpRequest stream UpStream",
            ]
        );
    }
}
