"""The inference dashboard: what each model's and each serving pod's GPU energy buys in tokens (J per output
token, J per 1,000 tokens, tokens per kWh, CO2 per 1,000 tokens, J per request) and the idle energy of the
windows in which they served nothing.

Every expression reads the recording rules of ``dashboards/rules/inference.yaml``, which join the serving
engines' own token counters (vLLM, SGLang, TGI, Triton) with the exporter's pod energy; docs/inference.md
says how. Plain data: this module never imports grafana-foundation-sdk.
"""

from __future__ import annotations

from dashboards.spec import (
    DATASOURCE_VAR,
    GRAM,
    JOULE,
    SHORT,
    TOKENS_PER_SECOND,
    WATT,
    Dashboard,
    Panel,
    Query,
    Row,
    Variable,
    sel,
)

_SERVING = "namespace_pod_model:inference_tokens:rate5m"

NAMESPACE_VAR = Variable("namespace", "Namespace", f"label_values({_SERVING}, namespace)", default_all=True,
                         all_value=".*",
                         description="Namespaces of the serving pods (the per-pod panels; the per-model ones add "
                                     "up every namespace).")
SERVER_VAR = Variable("server", "Server", f"label_values({_SERVING}, server)", default_all=True, all_value=".*",
                      description="Inference engines: vllm, sglang, tgi, triton.")
MODEL_VAR = Variable("model", "Model", f'label_values({_SERVING}{{server=~"$server"}}, model)', default_all=True,
                     all_value=".*",
                     description="Served models, as the engines name them (TGI names none: its pods show under "
                                 "All, with an empty model, unless the scrape job sets a model label).")

MODEL = 'model=~"$model", server=~"$server"'
NAMESPACE = 'namespace=~"$namespace"'
POD_MODEL = f"{NAMESPACE}, {MODEL}"
MODEL_LEGEND = "{{model}} ({{server}})"
POD_LEGEND = "{{namespace}}/{{pod}}"
#: The serving pods the variables select (a pod matches if it serves a selected model on a selected engine).
_SELECTED_PODS = sel(_SERVING, POD_MODEL)


def per_pod(record: str) -> str:
    """A per-pod recording rule, for the selected serving pods."""
    return f"{sel(record, NAMESPACE)} and on (namespace, pod) {_SELECTED_PODS}"


# J per output token over the dashboard range, per model: the mean power charged to the model over its
# mean output token rate (a ratio of means, not a mean of 5-minute ratios, so a busy hour weighs more than a
# quiet one), tokens of pods without energy left out as in the rules.
JOULES_PER_OUTPUT_TOKEN_RANGE = (
    f"sum by (model, server) (avg_over_time({sel('namespace_pod_model:inference_energy_joules:rate5m', MODEL)}"
    "[$__range]))"
    f" / (sum by (model, server) (avg_over_time({sel('namespace_pod_model:inference_generation_tokens:rate5m', MODEL)}"
    "[$__range])"
    " and on (namespace, pod) avg_over_time(namespace_pod:gpuenergy_k8s_pod_energy_joules:rate5m[$__range])) > 0)"
)

INFERENCE_DASHBOARD = Dashboard(
    name="inference",
    uid="gpuenergy-inference",
    title="GPU energy / Inference",
    description="What serving costs: GPU joules per output token and per 1,000 tokens, tokens per kWh and CO2 "
                "per 1,000 tokens, per model and per serving pod (vLLM, SGLang, TGI, Triton), and the idle "
                "energy of the windows without a token.",
    variables=(DATASOURCE_VAR, NAMESPACE_VAR, SERVER_VAR, MODEL_VAR),
    rows=(
        Row("Per model (every namespace)", (
            Panel("timeseries", "Energy per output token",
                  "GPU joules per generated token of each model over the last 5 minutes (recording rule "
                  "model_server:inference_energy_joules_per_output_token:ratio_rate5m): the energy of every "
                  "pod serving it (its share of a pod serving several models, by tokens; idle replicas "
                  "included) over the output tokens the engines counted. Prefill energy is in it: it is what "
                  "each generated token cost. No value in a window without output tokens (see idle energy).",
                  JOULE, (Query(sel("model_server:inference_energy_joules_per_output_token:ratio_rate5m", MODEL),
                                MODEL_LEGEND),),
                  width=12),
            Panel("bargauge", "Energy per output token over the range",
                  "GPU joules per generated token of each model over the whole dashboard range: the mean "
                  "power charged to the model over its mean output token rate. Windows without tokens add "
                  "their energy and no token.",
                  JOULE, (Query(JOULES_PER_OUTPUT_TOKEN_RANGE, MODEL_LEGEND),),
                  width=12),
            Panel("timeseries", "Tokens per kWh",
                  "Tokens (prompt + output) each model's serving pods produce per kWh of GPU energy, over the "
                  "last 5 minutes (model_server:inference_tokens_per_kwh:ratio_rate5m); 0 while they serve "
                  "nothing.",
                  SHORT, (Query(sel("model_server:inference_tokens_per_kwh:ratio_rate5m", MODEL), MODEL_LEGEND),),
                  width=8),
            Panel("timeseries", "CO2 per 1,000 tokens",
                  "Grams of CO2-equivalent per 1,000 tokens (prompt + output) of each model over the last 5 "
                  "minutes: each pod's share of its GPUs' CO2 counters (energy x PUE x the grid intensity in "
                  "force then), over the tokens (model_server:inference_co2_grams_per_1k_tokens:ratio_rate5m).",
                  GRAM, (Query(sel("model_server:inference_co2_grams_per_1k_tokens:ratio_rate5m", MODEL),
                               MODEL_LEGEND),),
                  width=8),
            Panel("timeseries", "Idle energy",
                  "GPU joules of each model's pods in the 5-minute windows in which they served no token at "
                  "all (model_server:inference_idle_energy_joules:increase5m): the cost of keeping a replica "
                  "ready. A pod serving several models shares it evenly.",
                  JOULE, (Query(sel("model_server:inference_idle_energy_joules:increase5m", MODEL), MODEL_LEGEND),),
                  width=8),
        )),
        Row("Per serving pod", (
            Panel("timeseries", "Energy per 1,000 tokens",
                  "GPU joules per 1,000 tokens (prompt + output) of each serving pod over the last 5 minutes "
                  "(namespace_pod:inference_energy_joules_per_1k_tokens:ratio_rate5m): the pod's settled GPU "
                  "energy (a pod over several GPUs sums them; a shared or MIG GPU counts the pod's share) "
                  "over the tokens its engine counted.",
                  JOULE, (Query(per_pod("namespace_pod:inference_energy_joules_per_1k_tokens:ratio_rate5m"),
                                POD_LEGEND),),
                  width=8),
            Panel("timeseries", "Energy per output token, per pod",
                  "GPU joules per generated token of each serving pod over the last 5 minutes "
                  "(namespace_pod:inference_energy_joules_per_output_token:ratio_rate5m).",
                  JOULE, (Query(per_pod("namespace_pod:inference_energy_joules_per_output_token:ratio_rate5m"),
                                POD_LEGEND),),
                  width=8),
            Panel("timeseries", "Energy per request",
                  "GPU joules per finished request of each serving pod over the last 5 minutes "
                  "(namespace_pod:inference_energy_joules_per_request:ratio_rate5m). The requests a server "
                  "batches share one forward pass: this is an average, not what any one request cost.",
                  JOULE, (Query(per_pod("namespace_pod:inference_energy_joules_per_request:ratio_rate5m"),
                                POD_LEGEND),),
                  width=8),
            Panel("timeseries", "Power of the serving pods",
                  "GPU power of each serving pod over the last 5 minutes, from the exporter's pod energy, "
                  "settled + provisional (namespace_pod:gpuenergy_k8s_pod_energy_joules:rate5m).",
                  WATT, (Query(per_pod("namespace_pod:gpuenergy_k8s_pod_energy_joules:rate5m"), POD_LEGEND),),
                  width=8),
            Panel("timeseries", "Tokens per second",
                  "Prompt and output tokens per second of each serving pod over the last 5 minutes, from the "
                  "engines' own counters (the throughput the engines report themselves, over the same window "
                  "as the energy).",
                  TOKENS_PER_SECOND, (
                      Query(f"sum by (namespace, pod) "
                            f"({sel('namespace_pod_model:inference_prompt_tokens:rate5m', POD_MODEL)})",
                            f"{POD_LEGEND} prompt"),
                      Query(f"sum by (namespace, pod) "
                            f"({sel('namespace_pod_model:inference_generation_tokens:rate5m', POD_MODEL)})",
                            f"{POD_LEGEND} output"),
                  ),
                  width=8),
            Panel("timeseries", "CO2 per 1,000 tokens, per pod",
                  "Grams of CO2-equivalent per 1,000 tokens of each serving pod over the last 5 minutes "
                  "(namespace_pod:inference_co2_grams_per_1k_tokens:ratio_rate5m).",
                  GRAM, (Query(per_pod("namespace_pod:inference_co2_grams_per_1k_tokens:ratio_rate5m"),
                               POD_LEGEND),),
                  width=8),
            Panel("timeseries", "Idle energy, per pod",
                  "GPU joules of each serving pod in the 5-minute windows without a token "
                  "(namespace_pod:inference_idle_energy_joules:increase5m). An SGLang or TGI server that has "
                  "not finished a request since it started has no token series yet, and so no idle series.",
                  JOULE, (Query(per_pod("namespace_pod:inference_idle_energy_joules:increase5m"), POD_LEGEND),),
                  width=24, height=6),
        )),
    ),
)
