"""Hand-written JSON schemas of the custom resource kinds in deploy/k8s (KEDA ScaledObject and
TriggerAuthentication, Prometheus Operator ServiceMonitor and PrometheusRule) and of the
Prometheus rule file deploy/prometheus/alerts.yaml."""

CRD_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
    "namespace": {"type": "string"}, "labels": _STR_MAP, "annotations": _STR_MAP}}
_DURATION = {"type": "string", "pattern": r"^((\d+)(ms|s|m|h|d|w))+$"}

CRD_SCHEMAS = {
    "ScaledObject": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "scalingModifiers": {"type": "object"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "name": {"type": "string"},
                            "behavior": {"type": "object", "additionalProperties": False,
                                         "properties": {"scaleUp": {"$ref": "#/$defs/rules"},
                                                        "scaleDown": {"$ref": "#/$defs/rules"}}}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"}, "name": {"type": "string"},
                        "metadata": _STR_MAP, "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {"type": "object", "required": ["name"],
                                              "properties": {"name": {"type": "string"},
                                                             "kind": {"enum": ["TriggerAuthentication",
                                                                               "ClusterTriggerAuthentication"]}}}},
                    "if": {"properties": {"type": {"const": "kafka"}}},
                    "then": {"properties": {"metadata": {
                        "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold",
                                     "activationLagThreshold"],
                        "properties": {"lagThreshold": {"pattern": r"^[1-9]\d*$"},
                                       "activationLagThreshold": {"pattern": r"^\d+$"},
                                       "allowIdleConsumers": {"enum": ["true", "false"]},
                                       "offsetResetPolicy": {"enum": ["earliest", "latest"]}}}}}}}}}},
        "$defs": {"rules": {"type": "object", "additionalProperties": False, "properties": {
            "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
            "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
            "policies": {"type": "array", "items": {
                "type": "object", "required": ["type", "value", "periodSeconds"], "additionalProperties": False,
                "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
                               "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}}}}}}},
    },
    "TriggerAuthentication": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "minProperties": 1,
            "properties": {"secretTargetRef": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
                "properties": {"parameter": {"type": "string"}, "name": {"type": "string"},
                               "key": {"type": "string"}}}}}}}},
    "ServiceMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": _STR_MAP}},
                "namespaceSelector": {"type": "object"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                    "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                   "interval": _DURATION, "scrapeTimeout": _DURATION}}}}}}},
    "PrometheusRule": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": _META, "spec": {
            "type": "object", "required": ["groups"], "additionalProperties": False,
            "properties": {"groups": {"$ref": "#/$defs/groups"}}}},
        "$defs": {},  # filled below with the rule-file schema
    },
}

RULE_FILE_SCHEMA = {
    "type": "object", "required": ["groups"], "additionalProperties": False,
    "properties": {"groups": {"$ref": "#/$defs/groups"}},
    "$defs": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "rules"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "interval": _DURATION, "rules": {
            "type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["expr"], "additionalProperties": False,
                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                "properties": {"alert": {"type": "string", "pattern": r"^[A-Za-z_]\w*$"},
                               "record": {"type": "string"}, "expr": {"type": "string", "minLength": 1},
                               "for": _DURATION, "keep_firing_for": _DURATION,
                               "labels": _STR_MAP, "annotations": _STR_MAP}}}}}}},
}
CRD_SCHEMAS["PrometheusRule"]["$defs"] = RULE_FILE_SCHEMA["$defs"]
