"""``with_structured_output`` for ChatPolyKV: a schema becomes a grammar, so the answer always parses.

Data flow:
  pydantic model / TypedDict / JSON schema -> JSON schema (langchain-core's converter)
  -> checked at bind time (:func:`polykv_agents.sampling.grammar.json_schema_grammar`: a schema that cannot
     be compiled is an error here, not mid-generation)
  -> the chat model bound with ``response_format={"type": "json_schema", ...}``; each call decodes
     under the grammar (:class:`polykv_agents.sampling.grammar.TokenConstraint`)
  -> a parser: the pydantic model's own validation, or plain JSON for TypedDicts and dict schemas.

``json_mode`` constrains to any JSON object and parses it (with the schema's pydantic model, if one is
given). ``function_calling`` binds the schema as the one tool the model must call
(:mod:`polykv_agents.prompting.tool_calls`) and parses that call's arguments. ``include_raw=True`` returns
``{"raw", "parsed", "parsing_error"}`` as LangChain's models do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import BaseOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ValidationError as PydanticValidationError
from pydantic.v1 import ValidationError as PydanticV1ValidationError

from polykv_agents.sampling.grammar import ANY_JSON_OBJECT, GrammarError, closed_schema, json_schema_grammar

METHODS = ("json_schema", "json_mode", "function_calling")


def response_format_grammar(response_format: Mapping[str, Any]) -> str:
    """The grammar of an OpenAI-style ``response_format``: ``{"type": "json_schema", "json_schema":
    {"schema": {...}}}`` or ``{"type": "json_object"}``.

    Raises:
        GrammarError: Another type, no schema, or a schema that cannot be compiled.
    """
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "json_object":
        return json_schema_grammar(ANY_JSON_OBJECT)
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if isinstance(schema, Mapping):
            return json_schema_grammar(schema)
    msg = (
        f"response_format must be {{'type': 'json_schema', 'json_schema': {{'name': ..., 'schema': {{...}}}}}} "
        f"or {{'type': 'json_object'}}, got {response_format!r}"
    )
    raise GrammarError(msg)


class CompleteJsonParser(BaseOutputParser[Any]):
    """JSON text to Python (validated by ``pydantic_object`` when given), refusing an incomplete document.

    langchain-core's ``JsonOutputParser`` and ``PydanticOutputParser`` repair truncated JSON into a
    partial object, which would pass an answer cut by ``max_tokens`` off as a complete one.
    """

    pydantic_object: Any = None

    def parse(self, text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            msg = f"the answer is not complete JSON ({e}); if it was cut by max_tokens, raise max_tokens"
            raise OutputParserException(msg, llm_output=text) from e
        if self.pydantic_object is None:
            return value
        try:
            if hasattr(self.pydantic_object, "model_validate"):
                return self.pydantic_object.model_validate(value)
            return self.pydantic_object.parse_obj(value)  # a pydantic.v1 model
        except (PydanticValidationError, PydanticV1ValidationError) as e:
            msg = f"the answer does not validate as {self.pydantic_object.__name__}: {e}"
            raise OutputParserException(msg, llm_output=text) from e

    @property
    def _type(self) -> str:
        return "polykv_complete_json"


def _parser(schema: Any) -> BaseOutputParser:
    is_model = isinstance(schema, type) and is_basemodel_subclass(schema)
    return CompleteJsonParser(pydantic_object=schema if is_model else None)


def _require_tool_call(message: AIMessage) -> AIMessage:
    if not message.tool_calls:
        msg = "the answer holds no complete tool call; if it was cut by max_tokens, raise max_tokens"
        raise OutputParserException(msg, llm_output=str(message.content))
    return message


def _response_format(schema: Any, method: str) -> dict[str, Any]:
    if method == "json_mode":
        return {"type": "json_object"}
    if schema is None:
        msg = "method='json_schema' needs a schema: a pydantic model, a TypedDict or a JSON schema"
        raise ValueError(msg)
    json_schema = closed_schema(convert_to_json_schema(schema))
    name = json_schema["title"]  # convert_to_json_schema refuses a schema without one
    return {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema, "strict": True}}


def structured_output(
    llm: Runnable, schema: Any, *, method: str = "json_schema", include_raw: bool = False
) -> Runnable:
    """``llm`` (a ChatPolyKV) answering with JSON that follows ``schema``, parsed.

    Raises:
        ValueError: An unknown ``method``, or no schema for ``json_schema`` or ``function_calling``.
        GrammarError: The schema cannot be compiled into a grammar.
    """
    if method not in METHODS:
        msg = f"method must be one of {', '.join(METHODS)}, got {method!r}"
        raise ValueError(msg)
    if method == "function_calling":
        return _function_calling(llm, schema, include_raw=include_raw)
    response_format = _response_format(schema, method)
    response_format_grammar(response_format)  # compile now: a bad schema fails at bind time
    bound = llm.bind(
        response_format=response_format,
        ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
    )
    return _with_parser(bound, _parser(schema), include_raw=include_raw)


def _function_calling(llm: Runnable, schema: Any, *, include_raw: bool) -> Runnable:
    """The schema as the one tool the model must call; its arguments are the answer."""
    if schema is None:
        msg = "method='function_calling' needs a schema: a pydantic model, a TypedDict or a JSON schema"
        raise ValueError(msg)
    name = convert_to_openai_tool(schema)["function"]["name"]
    bound = llm.bind_tools(
        [schema],
        tool_choice=name,
        ls_structured_output_format={"kwargs": {"method": "function_calling"}, "schema": schema},
    )
    if isinstance(schema, type) and is_basemodel_subclass(schema):
        parser: BaseOutputParser = PydanticToolsParser(tools=[schema], first_tool_only=True)
    else:
        parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    return _with_parser(bound, RunnableLambda(_require_tool_call) | parser, include_raw=include_raw)


def _with_parser(bound: Runnable, parser: Runnable, *, include_raw: bool) -> Runnable:
    if not include_raw:
        return bound | parser
    parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    keep_raw = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parse.with_fallbacks([keep_raw], exception_key="parsing_error")


__all__ = ["METHODS", "GrammarError", "response_format_grammar", "structured_output"]
