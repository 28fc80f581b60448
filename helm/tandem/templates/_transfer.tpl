{{/* KV transfer settings of the prefill and decode servers: flags, UCX environment, RDMA resources. */}}

{{- define "tandem.transfer.rdma" -}}
{{- eq .Values.transfer.protocol "rdma" -}}
{{- end -}}

{{/* `tandem serve` flags; Mooncake takes the RDMA devices as a flag, NIXL through UCX (see env below). */}}
{{- define "tandem.transfer.args" -}}
{{- $t := .Values.transfer -}}
- --transfer-backend
- {{ $t.backend }}
- --transfer-protocol
- {{ $t.protocol }}
{{- if and (eq $t.protocol "rdma") (eq $t.backend "mooncake") }}
- --transfer-device
- {{ join "," $t.rdma.devices | quote }}
{{- end }}
{{- end -}}

{{/* NIXL moves bytes with UCX: pick its transports (RC verbs for RDMA, TCP otherwise) and NICs. */}}
{{- define "tandem.transfer.env" -}}
{{- $t := .Values.transfer -}}
{{- if eq $t.backend "nixl" }}
{{- $gpu := ternary ",cuda_copy,cuda_ipc" "" (eq .Values.device "cuda") }}
- name: UCX_TLS
  value: {{ printf "%s,sm,self%s" (ternary "rc" "tcp" (eq $t.protocol "rdma")) $gpu | quote }}
{{- if eq $t.protocol "rdma" }}
{{- $nics := list }}
{{- range $t.rdma.devices }}{{ $nics = append $nics (printf "%s:1" .) }}{{ end }}
- name: UCX_NET_DEVICES
  value: {{ join "," $nics | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Extended resources of one engine pod: its GPUs (one per TP rank) and its RDMA device, as asked.
Called with (dict "root" $ "gpus" N). */}}
{{- define "tandem.transfer.resources" -}}
{{- $v := .root.Values -}}
{{- $res := dict -}}
{{- if eq $v.device "cuda" -}}{{- $_ := set $res $v.gpuResourceName .gpus -}}{{- end -}}
{{- if and (eq $v.transfer.protocol "rdma") $v.transfer.rdma.resourceName -}}
{{- $_ := set $res $v.transfer.rdma.resourceName $v.transfer.rdma.resourceCount -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}
